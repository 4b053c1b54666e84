"""The byte-plane codec (lightning_incremental.core.codecs.planes) and its predictors: round trips
at every element size, odd lengths, extreme values and special floats; corrupt payloads raise
ValueError; the predictor the sample picks is the one that wins."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_incremental.core.codecs import planes
from lightning_incremental.core.codecs import predict as pr

ITEMSIZES = (1, 2, 4, 8)


def _decode(payload: bytes, base: np.ndarray | None = None) -> np.ndarray:
    out = np.empty(int(planes.header(payload)["size"]), dtype=np.uint8)
    return planes.decode_into(payload, out, base)


def _floats(n: int, itemsize: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A float-like chunk and its slightly updated successor, as bytes (+ odd tail bytes)."""
    rng = np.random.default_rng(seed)
    dtype = {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    if itemsize == 1:
        base = rng.integers(-128, 127, n, dtype=np.int8)
        cur = (base + rng.integers(-2, 3, n)).astype(np.int8)
    else:
        base = (rng.standard_normal(n) * 0.02).astype(dtype)
        cur = (base + rng.standard_normal(n) * 1e-4).astype(dtype)
    return cur.view(np.uint8), base.view(np.uint8)


def _roundtrip(raw: np.ndarray, base: np.ndarray | None, itemsize: int, **kw) -> bytes:
    payload = planes.encode(raw, base, itemsize, **kw)
    out = np.full(raw.size, 0xAB, dtype=np.uint8)
    planes.decode_into(payload, out, base)
    assert out.tobytes() == raw.tobytes()
    return payload


_CASES = [
    (itemsize, predictor)
    for itemsize in ITEMSIZES
    for predictor in (None, pr.NONE, pr.XOR, pr.SUB, pr.SCALED)
    if predictor != pr.SCALED or itemsize in (2, 4)  # scaled: 2- and 4-byte floats only
]


@pytest.mark.parametrize(("itemsize", "predictor"), _CASES)
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
def test_round_trip_every_itemsize_and_odd_length(itemsize, extra, predictor):
    cur, base = _floats(5000, itemsize, seed=itemsize + extra)
    rng = np.random.default_rng(extra)
    tail = rng.integers(0, 256, extra, dtype=np.uint8)
    raw = np.concatenate([cur, tail])
    base = np.concatenate([base, tail[::-1]])
    _roundtrip(raw, base, itemsize, predictor=predictor)
    if predictor in (None, pr.NONE):
        _roundtrip(raw, None, itemsize, predictor=predictor)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_empty_and_shorter_than_one_element(itemsize):
    for n in range(itemsize + 1):
        raw = np.arange(n, dtype=np.uint8)
        _roundtrip(raw, None, itemsize)
        _roundtrip(raw, raw[::-1].copy(), itemsize)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_extreme_values_wrap_exactly(itemsize):
    """Differences that overflow the signed range still come back exactly."""
    info = np.iinfo({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    vals = np.array([0, 1, info.max, info.max // 2, info.max // 2 + 1], dtype=info.dtype)
    raw = np.tile(vals, 50)
    base = np.roll(raw, 1)
    for predictor in (pr.SUB, pr.XOR, pr.NONE, None):
        _roundtrip(raw.view(np.uint8), base.view(np.uint8), itemsize, predictor=predictor)


def test_unsupported_itemsize_falls_back_to_bytes():
    raw = np.arange(300, dtype=np.uint8)
    payload = _roundtrip(raw, raw[::-1].copy(), 3)
    assert planes.header(payload)["itemsize"] == 1


def test_zigzag_is_its_own_inverse_and_orders_by_magnitude():
    d = np.array([0, -1, 1, -2, 2, -(2**31), 2**31 - 1], dtype=np.int32).view(np.uint32)
    z = pr.zigzag(d.copy())
    assert z.tolist() == [0, 1, 2, 3, 4, 2**32 - 1, 2**32 - 2]
    assert pr.unzigzag(z).tolist() == d.tolist()


def test_small_update_shrinks_and_predictor_is_chosen():
    cur, base = _floats(1 << 18, 4, seed=1)
    delta = planes.encode(cur, base, 4)
    full = planes.encode(cur, None, 4)
    assert len(delta) < len(full) < cur.size
    assert planes.header(delta)["predictor"] in (pr.XOR, pr.SUB, pr.SCALED)
    assert planes.header(full)["predictor"] == pr.NONE


def test_incompressible_planes_are_stored_raw():
    raw = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    payload = planes.encode(raw, None, 4)
    assert len(payload) - raw.size < 64  # header only: every plane raw


def test_corrupt_payloads_raise_value_error():
    cur, base = _floats(4096, 4, seed=4)
    payload = bytes(planes.encode(cur, base, 4, predictor=pr.SUB))
    out = np.empty(cur.size, dtype=np.uint8)
    with pytest.raises(ValueError):
        planes.decode_into(payload, out, None)  # delta without base
    with pytest.raises(ValueError):
        planes.decode_into(payload[:-1], out, base)  # truncated
    with pytest.raises(ValueError):
        planes.decode_into(payload + b"x", out, base)  # trailing bytes
    with pytest.raises(ValueError):
        planes.decode_into(b"XXXX" + payload[4:], out, base)  # magic
    with pytest.raises(ValueError):
        planes.decode_into(payload, np.empty(cur.size - 4, np.uint8), base)  # wrong size
    with pytest.raises(ValueError):
        planes.encode(cur, base[:-4], 4)  # base of another size


def test_decode_is_bit_exact_for_nan_inf_denormals():
    vals = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38],
        dtype=np.float32,
    )
    raw = np.tile(vals, 100)
    base = np.roll(raw, 3)
    _roundtrip(raw.view(np.uint8), base.view(np.uint8), 4)


def _decaying(n: int, itemsize: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """exp_avg_sq-like: positive values, the new ones 0.99 x the old plus a little noise."""
    rng = np.random.default_rng(seed)
    base = (10.0 ** rng.uniform(-12, -4, n)).astype(np.float32)
    cur = (base * 0.99 * (1 + 1e-4 * rng.standard_normal(n))).astype(np.float32)
    if itemsize == 2:

        def to16(a):
            return (a.view(np.uint32) >> 16).astype(np.uint16)

        return to16(cur).view(np.uint8), to16(base).view(np.uint8)
    return cur.view(np.uint8), base.view(np.uint8)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_scaled_predictor_is_chosen_for_a_decaying_tensor_and_wins(itemsize):
    cur, base = _decaying(1 << 17, itemsize, seed=2)
    auto = _roundtrip(cur, base, itemsize)
    h = planes.header(auto)
    if itemsize == 4:
        assert h["predictor"] == pr.SCALED and abs(h["factor"] - 0.99) < 1e-3
        sub = planes.encode(cur, base, itemsize, predictor=pr.SUB)
        assert len(auto) < 0.9 * len(sub)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("factor", [0.5, 0.73, 0.999, 1.0, 1.7, 2.0])
def test_scaled_round_trip_with_special_bases(itemsize, factor):
    specials = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 1.2e-38, 3.4e38, -3.4e38, 1.0],
        dtype=np.float32,
    )
    rng = np.random.default_rng(int(factor * 100))
    base32 = np.concatenate([specials, rng.standard_normal(3000).astype(np.float32)])
    cur32 = np.roll(base32, 1) * np.float32(0.9)
    if itemsize == 2:
        base = (base32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        cur = (cur32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        base, cur = base32.view(np.uint8), cur32.view(np.uint8)
    _roundtrip(cur, base, itemsize, predictor=pr.SCALED, factor=factor)


def test_scaled_decode_is_bit_exact_when_subnormals_are_flushed():
    """Decode under flush-to-zero / denormals-are-zero gives the bytes encoded without."""
    torch = pytest.importorskip("torch")
    cur, base = _decaying(1 << 14, 4, seed=5)
    b = base.view(np.float32).copy()
    b[:100] = np.float32(1e-39) * np.arange(100, dtype=np.float32)  # subnormal bases
    base = b.view(np.uint8)
    payload = planes.encode(cur, base, 4, predictor=pr.SCALED, factor=0.51)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero mode on this CPU")
    try:
        assert _decode(payload, base).tobytes() == cur.tobytes()
    finally:
        torch.set_flush_denormal(False)


def test_scaled_refuses_other_itemsizes_and_bad_factors():
    raw = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError):
        planes.encode(raw, raw.copy(), 8, predictor=pr.SCALED, factor=0.9)
    with pytest.raises(ValueError):
        planes.encode(raw, raw.copy(), 4, predictor=pr.SCALED, factor=3.0)
    payload = bytearray(planes.encode(raw, raw[::-1].copy(), 4, predictor=pr.SCALED, factor=0.9))
    payload[planes._HEAD.size : planes._HEAD.size + planes._SCALE.size] = planes._SCALE.pack(7.0)
    with pytest.raises(ValueError):
        _decode(bytes(payload), raw[::-1].copy())


def _scaled_reference(base: np.ndarray, factor: float) -> np.ndarray:
    """The scaled prediction written plainly (one pass per step, no scratch memory): scale a
    float32 (or exactly widened bfloat16) whose biased exponent is in [3, 252], keep any other
    as it is, round bfloat16 back to nearest-even."""
    bits = base.astype(np.uint32) << 16 if base.itemsize == 2 else base
    exponent = (bits >> 23) & 0xFF
    usable = (exponent >= 3) & (exponent <= 252)
    with np.errstate(all="ignore"):
        product = (bits.view(np.float32) * np.float32(factor)).view(np.uint32)
    pred = np.where(usable, product, bits)
    if base.itemsize == 2:
        pred = ((pred + (np.uint32(0x7FFF) + ((pred >> 16) & 1))) >> 16).astype(np.uint16)
    return pred


@pytest.mark.parametrize("factor", [0.5, 0.501, 0.73, 0.999, 1.0, 1.0001, 1.37, 1.99, 2.0])
def test_scaled_prediction_matches_the_plain_definition_on_every_bf16_and_fp32_exponent(factor):
    factor = float(np.float32(factor))
    every_bf16 = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(
        pr.scaled_prediction(every_bf16, factor), _scaled_reference(every_bf16, factor)
    )
    rng = np.random.default_rng(7)
    exponents = np.repeat(np.arange(256, dtype=np.uint32), 64)
    fp32 = (
        (rng.integers(0, 2, exponents.size, dtype=np.uint32) << 31)
        | (exponents << 23)
        | rng.integers(0, 1 << 23, exponents.size, dtype=np.uint32)
    )
    out = np.empty_like(fp32)
    assert pr.scaled_prediction(fp32, factor, out=out) is out
    assert np.array_equal(out, _scaled_reference(fp32, factor))


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_chunks_of_different_sizes_in_turn_reuse_scratch_memory_exactly(itemsize):
    """One thread codes chunks of growing and shrinking sizes in turn (its scratch buffers are
    reused and resliced); every payload decodes to its chunk, and is the same as coded first."""
    sizes = [4096, 1 << 16, 100, 1 << 18, 8, 1 << 16]
    chunks = [_floats(n, itemsize, seed=i) for i, n in enumerate(sizes)]
    first = [bytes(planes.encode(cur, base, itemsize)) for cur, base in chunks]
    for (cur, base), payload in zip(reversed(chunks), reversed(first)):
        assert bytes(planes.encode(cur, base, itemsize)) == payload
        assert _decode(payload, base).tobytes() == cur.tobytes()
