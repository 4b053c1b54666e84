"""Properties of the chunk codecs (lightning_incremental.core.codecs), called as production
calls them: through the registry.

Round trips of the byte grouping and of every encoding, and a fuzzed decoder: whatever bytes it
is given, ``decode`` returns exactly ``size`` bytes or raises ``ValueError`` — never another
exception, never a buffer of the wrong size.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from lightning_incremental.core import codecs as codec

KIND_FULL = codec.STANDALONE.kind
KIND_XOR = codec.XOR.kind


def encode_full(raw: np.ndarray, width: int, level: int) -> bytes:
    blob = codec.get(KIND_FULL).encode(raw, None, width=width, level=level)
    assert blob is not None
    return blob


def encode_xor(raw: np.ndarray, base: np.ndarray, width: int, level: int) -> bytes:
    blob = codec.get(KIND_XOR).encode(raw, base, width=width, level=level)
    assert blob is not None
    return blob


WIDTHS = (1, 2, 4, 8)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def arr(data: bytes) -> np.ndarray:
    """A writable uint8 array holding ``data``."""
    return np.frombuffer(data, dtype=np.uint8).copy()


widths = st.sampled_from(WIDTHS)
levels = st.sampled_from([-3, 1, 3])
payloads = st.binary(max_size=3000)


@st.composite
def structured_payloads(draw: st.DrawFn) -> bytes:
    """Bytes that look like tensor data (compressible), not just noise."""
    kind = draw(st.sampled_from(["float32", "zeros", "ramp", "noise"]))
    n = draw(st.integers(0, 700))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "float32":
        return rng.standard_normal(n).astype(np.float32).tobytes()
    if kind == "zeros":
        return bytes(n)
    if kind == "ramp":
        return np.arange(n, dtype=np.int64).tobytes()
    return rng.bytes(n)


any_payloads = st.one_of(payloads, structured_payloads())


# ---------------------------------------------------------------- byte grouping


@fast
@given(data=any_payloads, width=widths)
@example(data=b"", width=8)
@example(data=b"\x01\x02\x03", width=2)  # length not a multiple of the width
@example(data=bytes(range(17)), width=4)
def test_group_ungroup_round_trip(data: bytes, width: int) -> None:
    raw = arr(data)
    grouped = codec.group_bytes(raw, width)
    assert grouped.dtype == np.uint8
    assert grouped.size == raw.size
    # a permutation of the bytes: the same multiset
    assert np.array_equal(np.sort(grouped), np.sort(raw))
    out = np.full(raw.size, 0xAA, dtype=np.uint8)
    restored = codec.ungroup_bytes(grouped.copy(), width, out)
    assert restored is out
    assert out.tobytes() == data


@pytest.mark.parametrize("width", [2, 4, 8])
def test_ungroup_bytes_of_a_chunk_of_several_blocks(width: int) -> None:
    """Assembled block by block (``INTERLEAVE_BLOCK`` elements a pass): a chunk of two blocks
    and a part, into a 2-D output as well as a flat one."""
    from lightning_incremental.core.codecs.bytes import INTERLEAVE_BLOCK

    n = 2 * INTERLEAVE_BLOCK + 3
    raw = np.random.default_rng(width).integers(0, 256, n * width, dtype=np.uint8)
    grouped = codec.group_bytes(raw, width)
    for shape in ((n * width,), (n, width)):
        out = np.zeros(shape, dtype=np.uint8)
        codec.ungroup_bytes(grouped, width, out)
        assert out.tobytes() == raw.tobytes()


@fast
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=3),
    width=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_interleave_assembles_each_element_from_its_byte_planes(
    sizes: list[int], width: int, seed: int
) -> None:
    """Byte ``k`` of element ``i`` is ``planes[k][i]`` (little endian), for every width; one
    thread's calls of several sizes in a row (its scratch buffers reused and grown) too."""
    from lightning_incremental.core.codecs.bytes import interleave

    rng = np.random.default_rng(seed)
    dtype = np.dtype(f"<u{width}")
    for n in sizes:
        want = rng.integers(0, 256, (n, width), dtype=np.uint8)
        out = np.full(n, 0xAB, dtype=dtype)
        assert interleave([np.ascontiguousarray(want[:, k]) for k in range(width)], out) is out
        assert out.view(np.uint8).reshape(n, width).tobytes() == want.tobytes()


@fast
@given(n_elems=st.integers(1, 300), width=widths, seed=st.integers(0, 2**32 - 1))
def test_group_bytes_puts_byte_k_of_every_element_in_plane_k(
    n_elems: int, width: int, seed: int
) -> None:
    raw = arr(np.random.default_rng(seed).bytes(n_elems * width))
    grouped = codec.group_bytes(raw, width)
    elems = raw.reshape(n_elems, width)
    for k in range(width):
        assert grouped[k * n_elems : (k + 1) * n_elems].tobytes() == elems[:, k].tobytes()


def test_group_bytes_of_float_noise_makes_a_zero_plane() -> None:
    # The point of grouping: the XOR of two nearby float32 arrays has all-zero high bytes,
    # which grouping gathers into one plane.
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1000).astype(np.float32)
    b = (a * np.float32(1 + 1e-6)).astype(np.float32)
    xor = np.bitwise_xor(a.view(np.uint8), b.view(np.uint8))
    planes = codec.group_bytes(xor, 4).reshape(4, -1)
    assert not planes[3].any()  # sign + high exponent bits unchanged (little-endian byte 3)


# ---------------------------------------------------------------- encode / decode


@fast
@given(data=any_payloads, width=widths, level=levels)
def test_encode_full_round_trip(data: bytes, width: int, level: int) -> None:
    raw = arr(data)
    blob = encode_full(raw, width, level)
    assert isinstance(blob, bytes)
    out = codec.decode(blob, KIND_FULL, width, raw.size)
    assert out.dtype == np.uint8
    assert out.tobytes() == data
    # the input is not modified
    assert raw.tobytes() == data


@fast
@given(
    data=any_payloads,
    width=widths,
    level=levels,
    seed=st.integers(0, 2**32 - 1),
    flips=st.integers(0, 50),
)
def test_encode_xor_round_trip_needs_its_base(
    data: bytes, width: int, level: int, seed: int, flips: int
) -> None:
    raw = arr(data)
    rng = np.random.default_rng(seed)
    base = raw.copy()
    if raw.size:
        idx = rng.integers(0, raw.size, size=flips)
        base[idx] = rng.integers(0, 256, size=flips, dtype=np.uint8)
    base_before = base.tobytes()
    blob = encode_xor(raw, base, width, level)
    out = codec.decode(blob, KIND_XOR, width, raw.size, base=base)
    assert out.tobytes() == data
    assert base.tobytes() == base_before  # the base is not modified
    # decoding the delta as standalone gives the XOR, not the data
    xor = codec.decode(blob, KIND_FULL, width, raw.size)
    assert xor.tobytes() == np.bitwise_xor(raw, base).tobytes()
    with pytest.raises(ValueError):
        codec.decode(blob, KIND_XOR, width, raw.size)  # no base
    with pytest.raises(ValueError):
        codec.decode(blob, KIND_XOR, width, raw.size, base=np.zeros(raw.size + 1, np.uint8))


@fast
@given(data=any_payloads, other=any_payloads, width=widths, level=levels)
def test_encode_xor_rejects_bases_of_another_size(
    data: bytes, other: bytes, width: int, level: int
) -> None:
    assume(len(data) != len(other))
    with pytest.raises(ValueError):
        encode_xor(arr(data), arr(other), width, level)


@fast
@given(
    data=any_payloads,
    width=widths,
    level=levels,
    with_base=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    changed=st.floats(0, 1),
)
def test_encode_best_round_trips_and_picks_the_smaller(
    data: bytes, width: int, level: int, with_base: bool, seed: int, changed: float
) -> None:
    raw = arr(data)
    base = None
    if with_base:
        rng = np.random.default_rng(seed)
        base = raw.copy()
        mask = rng.random(raw.size) < changed
        base[mask] ^= rng.integers(1, 256, size=int(mask.sum()), dtype=np.uint8)
    # The earlier race (z or x); the default race is tested in test_fewer_bytes.py.
    chosen, blob = codec.encode_best(
        raw, base, width, level, candidates=[codec.STANDALONE, codec.XOR]
    )
    kind = chosen.kind
    full = encode_full(raw, width, level)
    if base is None:
        assert kind == KIND_FULL
        assert blob == full
    else:
        delta = encode_xor(raw, base, width, level)
        assert kind in (KIND_FULL, KIND_XOR)
        assert len(blob) == min(len(full), len(delta))
        assert blob == (delta if kind == KIND_XOR else full)
    out = codec.decode(blob, kind, width, raw.size, base=base)
    assert out.tobytes() == data


def test_encode_best_prefers_xor_for_a_small_change_of_noise() -> None:
    rng = np.random.default_rng(1)
    base = arr(rng.bytes(8192))
    raw = base.copy()
    raw[100:110] ^= 0xFF
    chosen, blob = codec.encode_best(raw, base, 4, 1, candidates=[codec.STANDALONE, codec.XOR])
    kind = chosen.kind
    assert kind == KIND_XOR
    assert len(blob) < len(encode_full(raw, 4, 1)) // 10
    assert codec.decode(blob, kind, 4, raw.size, base=base).tobytes() == raw.tobytes()


@fast
@given(data=any_payloads, width=widths, use_out=st.booleans())
def test_decode_into_out(data: bytes, width: int, use_out: bool) -> None:
    raw = arr(data)
    blob = encode_full(raw, width, 1)
    out = np.full(raw.size, 7, dtype=np.uint8)
    result = codec.decode(blob, KIND_FULL, width, raw.size, out=out)
    assert result is out
    assert out.tobytes() == data


@fast
@given(data=any_payloads, width=widths, kind=st.sampled_from([KIND_FULL, KIND_XOR]))
def test_decode_rejects_a_wrong_size(data: bytes, width: int, kind: str) -> None:
    raw = arr(data)
    blob = encode_full(raw, width, 1)
    for size in {raw.size + 1, raw.size + width, 2 * raw.size + 16, raw.size - 1}:
        if size < 0:
            continue
        base = np.zeros(size, dtype=np.uint8)
        with pytest.raises(ValueError):
            codec.decode(blob, kind, width, size, base=base)


@fast
@given(
    data=any_payloads,
    width=widths,
    cut=st.integers(0, 10_000),
    kind=st.sampled_from([KIND_FULL, KIND_XOR]),
)
def test_decode_rejects_truncated_blobs(data: bytes, width: int, cut: int, kind: str) -> None:
    raw = arr(data)
    base = np.zeros(raw.size, dtype=np.uint8)
    blob = encode_xor(raw, base, width, 1) if kind == KIND_XOR else (encode_full(raw, width, 1))
    keep = cut % len(blob)  # strictly shorter than the blob
    if raw.size == 0:
        # A frame that declares 0 bytes of content is accepted once its header is complete;
        # what comes back is still exactly right (nothing). The engine never stores an empty
        # chunk (an empty tensor has no chunks).
        try:
            out = codec.decode(blob[:keep], kind, width, 0, base=base)
        except ValueError:
            return
        assert out.size == 0
        return
    with pytest.raises(ValueError):
        codec.decode(blob[:keep], kind, width, raw.size, base=base)


@fast
@given(
    data=any_payloads,
    width=widths,
    kind=st.sampled_from([KIND_FULL, KIND_XOR]),
    extra=st.binary(min_size=1, max_size=64),
)
def test_decode_rejects_trailing_garbage_or_returns_exact_size(
    data: bytes, width: int, kind: str, extra: bytes
) -> None:
    raw = arr(data)
    base = np.zeros(raw.size, dtype=np.uint8)
    blob = encode_full(raw, width, 1) + extra
    try:
        out = codec.decode(blob, kind, width, raw.size, base=base)
    except ValueError:
        return
    # zstd stops at the end of the first frame; what it returns must still be the data
    assert out.tobytes() == data


@fast
@given(
    data=st.binary(min_size=1, max_size=3000),
    width=widths,
    position=st.integers(0),
    mask=st.integers(1, 255),
)
@example(data=bytes(4) + b"\x01" + bytes(7), width=1, position=4, mask=0xC1)  # frame header
def test_a_flipped_byte_is_rejected_or_caught_by_the_chunk_hash(
    data: bytes, width: int, position: int, mask: int
) -> None:
    """Corruption never silently returns wrong bytes: decode raises, or its output has the
    right size and a hash other than the chunk's (the decoder's per-chunk check then fails)."""
    raw = arr(data)
    digest = codec.chunk_hash(raw)
    blob = bytearray(encode_full(raw, width, 1))
    blob[position % len(blob)] ^= mask
    try:
        out = codec.decode(bytes(blob), KIND_FULL, width, raw.size)
    except ValueError:
        return
    assert out.size == raw.size
    assert (codec.chunk_hash(out) == digest) == (out.tobytes() == data)


def _frame_declaring(content_size: int) -> bytes:
    """A zstd frame header (single segment, 8-byte content size field) that declares
    ``content_size`` bytes, followed by an empty raw last block."""
    return ZSTD_MAGIC + b"\xe0" + content_size.to_bytes(8, "little") + b"\x01\x00\x00"


@pytest.mark.parametrize("declared", [2**40, 2**56, 2**63 - 1])
def test_decode_rejects_a_frame_that_declares_more_than_size(declared: int) -> None:
    """A corrupt or hostile frame header must not make the decoder allocate what it declares:
    ``size`` (what the manifest promises) bounds the output, and the mismatch is a ValueError —
    which the store turns into CorruptCheckpointError and falls back — not a MemoryError."""
    with pytest.raises(ValueError):
        codec.decode(_frame_declaring(declared), KIND_FULL, 1, 4096)


def test_decode_rejects_an_unknown_kind() -> None:
    blob = encode_full(arr(b"abcd"), 1, 1)
    for kind in ("", "zz", "X", "full", None):
        with pytest.raises(ValueError, match="unknown chunk encoding"):
            codec.decode(blob, kind, 1, 4)  # type: ignore[arg-type]


# ---------------------------------------------------------------- fuzzed decoder


def _decode_or_value_error(
    blob: bytes, kind: str, width: int, size: int, base: np.ndarray | None
) -> None:
    try:
        out = codec.decode(blob, kind, width, size, base=base)
    except ValueError:
        return
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.uint8
    assert out.size == size


@settings(max_examples=300, deadline=None)
@given(
    blob=st.one_of(
        st.binary(max_size=512),
        st.binary(max_size=512).map(lambda b: ZSTD_MAGIC + b),
    ),
    kind=st.sampled_from([KIND_FULL, KIND_XOR, "q"]),
    width=st.sampled_from([1, 2, 3, 4, 8, 16]),
    size=st.integers(0, 4096),
    with_base=st.booleans(),
)
@example(
    blob=ZSTD_MAGIC + b"\xf0" + bytes(7) + b"\x01", kind=KIND_FULL, width=1, size=0, with_base=False
)
def test_fuzz_decode_raises_only_value_error(
    blob: bytes, kind: str, width: int, size: int, with_base: bool
) -> None:
    base = np.zeros(size, dtype=np.uint8) if with_base else None
    _decode_or_value_error(blob, kind, width, size, base)


@settings(max_examples=200, deadline=None)
@given(
    data=any_payloads,
    width=widths,
    edits=st.lists(st.tuples(st.integers(0), st.integers(0, 255)), min_size=1, max_size=8),
    size_delta=st.sampled_from([0, 0, 0, -1, 1, 1000]),
)
def test_fuzz_decode_of_garbled_valid_blobs(
    data: bytes, width: int, edits: list[tuple[int, int]], size_delta: int
) -> None:
    raw = arr(data)
    blob = bytearray(encode_full(raw, width, 1))
    for position, value in edits:
        blob[position % len(blob)] = value
    size = max(0, raw.size + size_delta)
    _decode_or_value_error(bytes(blob), KIND_FULL, width, size, None)
    _decode_or_value_error(bytes(blob), KIND_XOR, width, size, np.zeros(size, dtype=np.uint8))


# ---------------------------------------------------------------- hashing


HEX32 = re.compile(r"^[0-9a-f]{32}$")


@fast
@given(data=st.binary(max_size=5000))
def test_chunk_hash_is_32_lowercase_hex_and_container_independent(data: bytes) -> None:
    digest = codec.chunk_hash(data)
    assert HEX32.match(digest)
    assert len(digest) == codec.HASH_LEN
    assert codec.chunk_hash(arr(data)) == digest
    assert codec.chunk_hash(memoryview(data)) == digest
    assert codec.chunk_hash(bytes(data)) == digest


@fast
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000))
@example(a=b"", b=b"\x00")
@example(a=b"\x00" * 16, b=b"\x00" * 17)
def test_chunk_hash_differs_for_different_inputs(a: bytes, b: bytes) -> None:
    assume(a != b)
    assert codec.chunk_hash(a) != codec.chunk_hash(b)


@fast
@given(data=st.binary(min_size=1, max_size=2000), position=st.integers(0), bit=st.integers(0, 7))
def test_chunk_hash_sees_every_bit(data: bytes, position: int, bit: int) -> None:
    flipped = bytearray(data)
    flipped[position % len(data)] ^= 1 << bit
    assert codec.chunk_hash(bytes(flipped)) != codec.chunk_hash(data)


def test_chunk_hash_of_a_strided_view_hashes_its_bytes() -> None:
    a = np.arange(64, dtype=np.uint8)
    assert codec.chunk_hash(a[10:20]) == codec.chunk_hash(bytes(range(10, 20)))


# ---------------------------------------------------------------- group width


@pytest.mark.parametrize(
    ("itemsize", "is_complex", "expected"),
    [
        (1, False, 1),
        (2, False, 2),
        (4, False, 4),
        (8, False, 8),
        (3, False, 1),
        (16, False, 1),
        (32, False, 1),
        (12, False, 1),
        (2, True, 1),
        (4, True, 2),
        (8, True, 4),
        (16, True, 8),
        (32, True, 1),
    ],
)
def test_group_width_values(itemsize: int, is_complex: bool, expected: int) -> None:
    assert codec.group_width(itemsize, is_complex) == expected


ALL_DTYPES = [
    getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "float64",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex32",
        "complex64",
        "complex128",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_group_width_of_every_torch_dtype_divides_its_element(dtype: torch.dtype) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    width = codec.group_width(size, dtype.is_complex)
    assert width in WIDTHS
    assert size % width == 0
    if dtype.is_complex:
        assert width == size // 2
    else:
        assert width == size
