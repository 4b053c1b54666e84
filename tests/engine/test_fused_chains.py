"""Fused chain decoding: the links of a chain with arithmetic predictors decoded together,
range by range (``Codec.blocks``, ``decoder._decode_fused``), equal to decoding them one by one,
and naming the bad link the same way."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core import CheckpointStore, codecs
from lightning_incremental.core.chunks import decode as dec
from lightning_incremental.core.codecs import planes
from lightning_incremental.core.codecs import predict as pr
from lightning_incremental.core.errors import CorruptCheckpointError
from tests.conftest import walk_store

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _walk(rng: np.random.Generator, itemsize: int, n: int, links: int) -> list[np.ndarray]:
    """``links`` versions of a float-like array, each a small step from the one before; plus
    ``n`` trailing bytes that are not a whole element (a tail)."""
    if itemsize in (2, 4, 8):
        kind = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
        value = rng.standard_normal(n).astype(kind)
        out = []
        for _ in range(links):
            value = value * kind(0.999) + rng.standard_normal(n).astype(kind) * kind(1e-3)
            out.append(value.view(np.uint8).copy())
        return out
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(links)]


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 3000),
    tail=st.integers(0, 7),
    predictors=st.lists(st.sampled_from([pr.XOR, pr.SUB, pr.SCALED]), min_size=1, max_size=4),
    cuts=st.lists(st.integers(1, 400), min_size=0, max_size=6),
    mixed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_blocks_decode_a_chain_range_by_range_as_link_by_link(
    itemsize: int,
    n: int,
    tail: int,
    predictors: list[int],
    cuts: list[int],
    mixed: bool,
    seed: int,
) -> None:
    """A root and its deltas (any predictor, any element size, a tail of loose bytes), decoded
    together over ranges cut anywhere on 8-byte boundaries, give every link's bytes exactly —
    also when the links are coded with different element sizes (the encoder never mixes them,
    a hand-made manifest may)."""
    rng = np.random.default_rng(seed)
    tail = tail % itemsize if itemsize > 1 else 0
    versions = _walk(rng, itemsize, n, len(predictors) + 1)
    ends = rng.integers(0, 256, tail, dtype=np.uint8)
    versions = [np.concatenate([v, ends if i % 2 else ends[::-1]]) for i, v in enumerate(versions)]
    size = versions[0].size
    payloads = [planes.encode(versions[0], None, itemsize, predictor=pr.NONE)]
    for before, after, predictor in zip(versions, versions[1:], predictors):
        width = int(rng.choice([1, 2, 4, 8])) if mixed else itemsize
        if predictor == pr.SCALED and width not in (2, 4):
            predictor = pr.SUB
        payloads.append(planes.encode(after, before, width, predictor=predictor))
    kinds = [codecs.PLANES] + [codecs.PLANES_DELTA] * len(predictors)
    readers = [codec.blocks(p, size) for codec, p in zip(kinds, payloads)]
    bounds = sorted({0, size, *(min(size, 8 * c * (1 + k)) for k, c in enumerate(cuts))})
    out = np.full(size, 0xA5, dtype=np.uint8)
    seen: list[list[bytes]] = [[] for _ in readers]
    for start, stop in itertools.pairwise(bounds):
        for i, blocks in enumerate(readers):
            assert blocks is not None
            blocks.decode(out, start, stop)
            seen[i].append(out[start:stop].tobytes())
    for i, version in enumerate(versions):
        assert b"".join(seen[i]) == version.tobytes(), f"link {i}"


def _read_all(store: CheckpointStore) -> tuple[dec.ObjectReader, dict]:
    doc = store.manifest()
    reader = dec.ObjectReader(store.storage, doc, "t")
    for plan in reader.plan(set(doc.chunks)):
        reader.read(plan)
    return reader, doc.chunks


@pytest.mark.parametrize(
    ("steps", "budget"),
    [(2, None), (3, None), (dec.FUSE_MAX, None), (dec.FUSE_MAX + 1, None), (3, 3 * 4096 - 1)],
)
def test_dense_chains_decode_fused_up_to_fuse_max_links(
    tmp_path: Path, steps: int, budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains with arithmetic links decode fused (no link-by-link pass) up to ``FUSE_MAX``
    links and ``FUSE_BYTES`` (links times the chunk's size), link by link beyond; either way
    equal to the state saved."""
    if budget is not None:  # between the chunks' sizes: 4096 bytes, and the tensors' last 3808
        monkeypatch.setattr(dec, "FUSE_BYTES", budget)
    store, state = walk_store(str(tmp_path / "s"), steps)
    reader, chunks = _read_all(store)
    by_links: list[int] = []
    links = dec._decode_links

    def counted(chain, *args):  # type: ignore[no-untyped-def]
        by_links.append(len(chain))
        links(chain, *args)

    monkeypatch.setattr(dec, "_decode_links", counted)
    lengths, fused, unfused = set(), 0, 0
    for entry in store.manifest().tensors:
        for digest in entry.chunks:
            chain = dec.closure(digest, chunks)
            lengths.add(len(chain))
            if not all(
                codecs.get(chunks[link].kind).foldable(reader.blobs[link]) for link in chain
            ):  # an arithmetic chain: fused within the bounds
                size = chunks[digest].size
                if len(chain) <= dec.FUSE_MAX and len(chain) * size <= dec.FUSE_BYTES:
                    fused += 1
                else:
                    unfused += 1
            out = np.zeros(chunks[digest].size, dtype=np.uint8)
            dec.decode_chunk(digest, chunks, reader.blobs, out, "t")
            assert dec.chunk_hash(out) == chunks[digest].expected(digest)
    assert lengths == {steps} and fused + unfused >= 2
    assert by_links == [steps] * unfused
    if budget is not None:
        assert fused and unfused  # both sides of the bound
    else:
        assert (fused == 0) == (steps > dec.FUSE_MAX)
    loaded = store.load()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    store.close()


def _raw_plane_byte(payload: bytearray) -> int:
    """The offset of a byte in a plane stored raw (a low mantissa plane) of a planes payload."""
    h = planes.header(payload)
    pos = planes._HEAD.size + (planes._SCALE.size if h["predictor"] == pr.SCALED else 0)
    table = [
        planes._PLANE.unpack_from(payload, pos + i * planes._PLANE.size)
        for i in range(int(h["planes"]))
    ]
    pos += len(table) * planes._PLANE.size + int(h["tail"])
    for method, length in table:
        if method == planes.RAW:
            return pos + length // 2
        pos += length
    raise AssertionError("no raw plane")


@pytest.mark.parametrize("bad", [0, 1, 2])
@pytest.mark.parametrize("damage", ["bytes", "header"])
def test_a_damaged_link_of_a_fused_chain_is_named(tmp_path: Path, bad: int, damage: str) -> None:
    """A link whose payload still decodes to wrong bytes fails its own checksum, and a link
    that cannot be decoded is reported as such: the message names that link, not the chunk
    at the end of the chain — as link-by-link decoding does."""
    store, _ = walk_store(str(tmp_path / "s"), 3)
    reader, chunks = _read_all(store)
    digest = next(  # a chain with an arithmetic link: decoded fused
        d
        for entry in store.manifest().tensors
        for d in entry.chunks
        if not all(
            codecs.get(chunks[link].kind).foldable(reader.blobs[link])
            for link in dec.closure(d, chunks)
        )
    )
    chain = dec.closure(digest, chunks)
    assert len(chain) == 3
    link = chain[bad]
    payload = bytearray(reader.blobs[link])
    if damage == "bytes":
        payload[_raw_plane_byte(payload)] ^= 0x01  # still decodes, to other bytes
    else:
        payload[:4] = b"JUNK"
    blobs = dict(reader.blobs)
    blobs[link] = memoryview(bytes(payload))
    expected = "fails its checksum" if damage == "bytes" else "cannot be decoded"
    out = np.zeros(chunks[digest].size, dtype=np.uint8)
    for decode in (dec.decode_chunk, lambda d, *a: dec._decode_links(dec.closure(d, chunks), *a)):
        with pytest.raises(CorruptCheckpointError, match=expected) as info:
            decode(digest, chunks, blobs, out, "t")
        assert link in str(info.value)
        assert all(other not in str(info.value) for other in chain if other != link)
    store.close()


def test_a_codec_with_grouped_planes_folds_by_default() -> None:
    """A codec that gives ``planes`` (the byte-grouped zstd ones) folds without saying so; one
    without does not; the byte-plane codecs tell from the payload's predictor."""
    assert codecs.STANDALONE.foldable(b"") and codecs.XOR.foldable(b"")
    assert not codecs.INT8.foldable(b"")
    raw = np.arange(4096, dtype=np.float32).view(np.uint8)
    moved = (np.arange(4096, dtype=np.float32) * np.float32(1.001)).view(np.uint8)
    xor = planes.encode(moved, raw, 4, predictor=pr.XOR)
    sub = planes.encode(moved, raw, 4, predictor=pr.SUB)
    assert codecs.PLANES_DELTA.foldable(xor) and not codecs.PLANES_DELTA.foldable(sub)
    with pytest.raises(ValueError, match="delta chunk holds a standalone payload"):
        codecs.PLANES_DELTA.foldable(planes.encode(raw, None, 4, predictor=pr.NONE))
