"""The default lossless codec: a predictor, byte planes, zstd only on the planes that shrink.

One chunk becomes a self-describing payload:

1. *Predictor* (:mod:`.predict`) against the same chunk of the previous checkpoint when there is
   one: ``xor``, ``sub`` (zigzag integer difference) or ``scaled``, chosen per chunk on a sample
   (a few spread slices, every candidate coded as in step 3), or ``none``. The store remembers
   each place's choice and reuses it at the next saves (``PlanesDelta.encode_as``; see
   ``hints.Hints``) instead of racing again.
2. *Byte planes*: plane ``k`` holds byte ``k`` of every element. After a small update of a float
   tensor the sign/exponent plane is almost constant while the low mantissa planes are noise.
3. *Per-plane coding*: each plane is zstd-compressed, and stored raw when zstd saves less than
   ``MIN_SAVING`` of it — the low mantissa planes: no entropy coder runs on them at decode, and
   zstd gives up on them early at encode.

At the default compression level (1) the planes are coded with zstd's fast strategy tuned for
them (``PLANE_PARAMS``): as small as level 1 and up to twice as fast on sign/exponent planes.

Registered as two codecs: ``p`` (standalone) and ``pd`` (against a base). ``pd`` weighs its
predictors against coding the chunk standalone and declines (returns None) when standalone
wins, so the encoder never codes a chunk both ways (see ``Codec.standalone``). A chain of
standalone and XOR links combines by XOR of their planes (``Codec.planes``) and restores in
one pass; a link with an arithmetic predictor is decoded link by link.

Payload layout (little endian)::

    magic "LPZ1" | itemsize u8 | predictor u8 | planes u8 | tail u8 | size u64
    [scaled predictor only: factor f32]
    per plane: method u8 (0 raw, 1 zstd) | length u32
    tail bytes | plane payloads in order

A chunk whose length is not a multiple of ``itemsize`` keeps its last ``len % itemsize`` bytes
raw (the tail).
"""

from __future__ import annotations

import functools
import struct
import threading

import numpy as np
import zstandard

from lightning_incremental.core.buffers import gather
from lightning_incremental.core.codecs import predict as pr
from lightning_incremental.core.codecs.bytes import compress, decompress, interleave, scratch
from lightning_incremental.core.codecs.registry import Codec, register

MAGIC = b"LPZ1"
RAW, ZSTD = 0, 1
MIN_SAVING = 0.02  # a plane is stored compressed only when that saves this fraction of it
# Predictor choice: SAMPLE_SLICES slices spread over the chunk, each about 1/256 of it but at
# least SAMPLE_SLICE_MIN and at most SAMPLE_SLICE elements (a sample of about 1.6 % of a chunk
# costs a few % of its encoding per candidate, whatever the chunk's size); chunks shorter than
# twice such a sample are tried whole.
SAMPLE_SLICES = 4
SAMPLE_SLICE = 4096
SAMPLE_SLICE_MIN = 1024
TUNED_LEVEL = 1  # the compression level coded with PLANE_PARAMS
# Elements predicted and split into planes (or assembled and unpredicted) per pass: the scratch
# memory a thread keeps is a block's, not a chunk's (measured as fast as whole chunks).
BLOCK = 1 << 17
# A delta predictor that saves less than this fraction of the chunk's raw size over XOR loses to
# it: a chain of XOR deltas restores in one pass (their planes XOR together, see ``grouped``),
# an arithmetic one link by link. Sparse updates (most elements unchanged) code about the same
# either way and chain deepest (up to max_chain links); under dense updates the arithmetic
# predictors save more (weights about 3 % of the raw size, second moments more): they stay.
XOR_MARGIN = 0.02

# A sign/exponent plane is mostly an i.i.d. stream of a few symbols: its gain comes from zstd's
# Huffman-coded literals, and short matches only cost time.
PLANE_PARAMS = {
    "strategy": zstandard.STRATEGY_FAST,
    "min_match": 7,
    "hash_log": 7,  # 1.4x faster than 12 on these planes (a table small enough for L1), no larger
    "chain_log": 7,
    "search_log": 1,
    "window_log": 17,
    "target_length": 0,  # > 0 would turn off Huffman-coded literals for the fast strategy
}

_HEAD = struct.Struct("<4sBBBBQ")
_SCALE = struct.Struct("<f")
_PLANE = struct.Struct("<BI")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


def _compress(plane: np.ndarray, level: int) -> bytes:
    if level != TUNED_LEVEL:
        return compress(plane, level)
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        params = zstandard.ZstdCompressionParameters(write_content_size=1, **PLANE_PARAMS)
        cctx = _local.cctx = zstandard.ZstdCompressor(compression_params=params)
    return cctx.compress(plane.data)


def to_planes(elems: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``(itemsize, n)`` uint8: plane ``k`` is byte ``k`` of every element (little endian), into
    ``out`` when given.

    Each plane is a shift and a narrowing cast of the elements — contiguous, vectorised passes,
    about twice as fast as copying every ``itemsize``-th byte."""
    width = elems.itemsize
    planes = np.empty((width, elems.size), dtype=np.uint8) if out is None else out
    if width == 1:
        planes[0] = elems
        return planes
    shifted = scratch("shift", elems.size, elems.dtype)
    for k in range(width):
        if k:
            np.right_shift(elems, 8 * k, out=shifted)
        np.copyto(planes[k], shifted if k else elems, casting="unsafe")  # keeps the low byte
    return planes


def from_planes(planes: list[np.ndarray], elems: np.ndarray) -> None:
    """Inverse of :func:`to_planes`: assemble ``elems`` (unsigned, ``len(planes)`` bytes each)
    from its byte planes (uint8 arrays of ``elems.size``)."""
    interleave(planes, elems)


def _code_plane(plane: np.ndarray, level: int) -> tuple[int, bytes | memoryview]:
    blob = _compress(plane, level)
    if len(blob) <= plane.size * (1 - MIN_SAVING):
        return ZSTD, blob
    return RAW, plane.data


def _planes_of(resid: np.ndarray) -> np.ndarray:
    """The byte planes of ``resid`` in this thread's scratch memory (valid until the next call)."""
    out = scratch("planes", resid.size * resid.itemsize, np.uint8)
    return to_planes(resid, out.reshape(resid.itemsize, resid.size))


def _coded_size(resid: np.ndarray, level: int) -> int:
    return sum(len(_code_plane(p, level)[1]) for p in _planes_of(resid))


def _sample(elems: np.ndarray) -> np.ndarray:
    return _sample_of(elems.size)


@functools.lru_cache(maxsize=64)
def _sample_of(n: int) -> np.ndarray:
    """The sample's element indices in a chunk of ``n`` elements (read-only: shared)."""
    length = min(SAMPLE_SLICE, max(SAMPLE_SLICE_MIN, n // 256))
    if n < 2 * SAMPLE_SLICES * length:
        idx = np.arange(n)
    else:
        stride = n // SAMPLE_SLICES
        slices = [np.arange(i * stride, i * stride + length) for i in range(SAMPLE_SLICES)]
        idx = np.concatenate(slices)
    idx.flags.writeable = False
    return idx


def choose_predictor(
    elems: np.ndarray, base: np.ndarray | None, level: int = TUNED_LEVEL
) -> tuple[int, float]:
    """The predictor (and scale factor) whose residual codes smallest on a sample of the chunk;
    ties go to ``none`` (no dependency on the base), then ``sub``; ``xor`` wins whenever a
    winning delta predictor saves less than ``XOR_MARGIN`` of the sample's raw size over it
    (its chains restore in one pass)."""
    if base is None:
        return pr.NONE, 1.0
    idx = _sample(elems)
    e, b = elems[idx], base[idx]
    candidates = [(pr.NONE, 1.0), (pr.SUB, 1.0), (pr.XOR, 1.0)]
    if elems.itemsize in (2, 4):
        factor = pr.estimate_scale(e, b)
        if factor != 1.0:
            candidates.append((pr.SCALED, factor))
    resid = scratch("resid", e.size, e.dtype)
    sizes = [_coded_size(pr.predict(e, b, p, f, out=resid), level) for p, f in candidates]
    best = sizes.index(min(sizes))
    xor = sizes[candidates.index((pr.XOR, 1.0))]
    if candidates[best][0] != pr.NONE and xor - sizes[best] <= XOR_MARGIN * e.nbytes:
        return pr.XOR, 1.0  # nearly as small, and its chains restore in one pass
    return candidates[best]


def encode(
    raw: np.ndarray,
    base: np.ndarray | None,
    itemsize: int,
    *,
    level: int = TUNED_LEVEL,
    predictor: int | None = None,
    factor: float | None = None,
) -> memoryview:
    """The payload of one chunk (``raw``, uint8) against ``base`` (same length) or standalone.

    ``predictor`` forces one (``factor`` for the scaled one, estimated when not given); by
    default both are chosen on a sample of the chunk. An ``itemsize`` other than 1, 2, 4 or 8
    codes single bytes.

    Raises:
        ValueError: ``base`` of another length, or a forced predictor that does not apply.
    """
    if itemsize not in _UINT:
        itemsize = 1
    if base is not None and base.size != raw.size:
        raise ValueError(f"base has {base.size} bytes, chunk has {raw.size}")
    tail = raw.size % itemsize
    body = raw.size - tail
    elems = raw[:body].view(_UINT[itemsize])
    base_elems = base[:body].view(_UINT[itemsize]) if base is not None else None
    if predictor is None:
        predictor, factor = choose_predictor(elems, base_elems, level)
    elif predictor != pr.NONE and base_elems is None:
        raise ValueError("a predictor against a base needs a base")
    elif predictor == pr.SCALED and factor is None:
        assert base_elems is not None
        idx = _sample(elems)
        factor = pr.estimate_scale(elems[idx], base_elems[idx])
    factor = 1.0 if factor is None else float(np.float32(factor))  # as stored
    if predictor == pr.SCALED and itemsize not in (2, 4):
        raise ValueError("the scaled predictor needs 2- or 4-byte elements")
    n = elems.size
    grid = scratch("planes", body, np.uint8).reshape(itemsize, n)
    for start in range(0, n, BLOCK):  # block by block: the scratch memory is a block's
        stop = min(n, start + BLOCK)
        resid = pr.predict(
            elems[start:stop],
            base_elems[start:stop] if base_elems is not None else None,
            predictor,
            factor,
            out=scratch("resid", stop - start, elems.dtype),
        )
        to_planes(resid, grid[:, start:stop])
    coded = [_code_plane(p, level) for p in grid] if body else []
    parts: list[bytes | memoryview] = [
        _HEAD.pack(MAGIC, itemsize, predictor, len(coded), tail, raw.size)
    ]
    if predictor == pr.SCALED:
        parts.append(_SCALE.pack(factor))
    parts += [_PLANE.pack(method, len(blob)) for method, blob in coded]
    parts.append(raw[body:].tobytes())
    parts += [blob for _, blob in coded]
    return gather(parts)


def header(payload: bytes | memoryview) -> dict[str, int | float]:
    """The fields of a payload's header.

    Raises:
        ValueError: not a valid header.
    """
    if len(payload) < _HEAD.size:
        raise ValueError("payload shorter than its header")
    magic, itemsize, predictor, planes, tail, size = _HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise ValueError(f"bad magic {bytes(magic)!r}")
    if itemsize not in _UINT or predictor not in pr.NAMES or tail >= itemsize:
        raise ValueError("bad header")
    if planes != (itemsize if size - tail else 0) or (size - tail) % itemsize:
        raise ValueError("bad header: plane count or size")
    factor = 1.0
    if predictor == pr.SCALED:
        if itemsize not in (2, 4) or len(payload) < _HEAD.size + _SCALE.size:
            raise ValueError("bad header: scaled predictor")
        (factor,) = _SCALE.unpack_from(payload, _HEAD.size)
        if not 0.5 <= factor <= 2.0:
            raise ValueError(f"bad header: scale factor {factor}")
    return {
        "itemsize": itemsize,
        "predictor": predictor,
        "planes": planes,
        "tail": tail,
        "size": size,
        "factor": factor,
    }


def _read_planes(
    payload: bytes | memoryview, h: dict[str, int | float]
) -> tuple[list[np.ndarray], np.ndarray]:
    """The byte planes of a payload (raw planes as views of it, zstd planes decompressed) and
    its tail bytes.

    Raises:
        ValueError: a truncated or malformed payload.
    """
    view = memoryview(payload)
    size, itemsize, tail = int(h["size"]), int(h["itemsize"]), int(h["tail"])
    n = (size - tail) // itemsize
    pos = _HEAD.size + (_SCALE.size if h["predictor"] == pr.SCALED else 0)
    count = int(h["planes"])
    if len(view) < pos + count * _PLANE.size + tail:
        raise ValueError("payload truncated")
    table = [_PLANE.unpack_from(view, pos + i * _PLANE.size) for i in range(count)]
    pos += count * _PLANE.size
    tail_bytes = np.frombuffer(view[pos : pos + tail], dtype=np.uint8)
    pos += tail
    planes = []
    for method, length in table:
        blob = view[pos : pos + length]
        pos += length
        if len(blob) != length:
            raise ValueError("payload truncated")
        if method == RAW:
            if length != n:
                raise ValueError(f"raw plane of {length} bytes, expected {n}")
            planes.append(np.frombuffer(blob, dtype=np.uint8))
        elif method == ZSTD:
            planes.append(np.frombuffer(decompress(blob, n), dtype=np.uint8))
        else:
            raise ValueError(f"unknown plane method {method}")
    if pos != len(view):
        raise ValueError("trailing bytes after the last plane")
    return planes, tail_bytes


def decode_into(
    payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None = None
) -> np.ndarray:
    """Decode ``payload`` into ``out`` (uint8, exactly the chunk's size); returns ``out``.

    Raises:
        ValueError: not a valid payload of ``out.size`` bytes, or a delta without its base.
    """
    h = header(payload)
    size = int(h["size"])
    if out.size != size:
        raise ValueError(f"payload holds {size} bytes, out has {out.size}")
    if h["predictor"] != pr.NONE and (base is None or base.size != size):
        raise ValueError("delta payload without a base of the same size")
    Blocks(payload, size, h).decode(out, 0, size, base)
    return out


class Blocks:
    """A payload's planes, read once (zstd planes decompressed, raw planes as views of it),
    decoded range by range: the links of a chain with arithmetic predictors are then decoded
    together, block by block, each block staying in cache from the chain's root to its last
    link (see ``Codec.blocks``).

    Raises:
        ValueError: a malformed payload, or one of another size.
    """

    def __init__(
        self, payload: bytes | memoryview, size: int, h: dict[str, int | float] | None = None
    ) -> None:
        h = header(payload) if h is None else h
        if int(h["size"]) != size:
            raise ValueError(f"payload holds {h['size']} bytes, expected {size}")
        self.itemsize, self.size = int(h["itemsize"]), size
        self.predictor, self.factor = int(h["predictor"]), float(h["factor"])
        self.body = size - int(h["tail"])
        self.planes, self.tail = _read_planes(payload, h)

    def decode(
        self, out: np.ndarray, start: int, stop: int, base: np.ndarray | None = None
    ) -> None:
        """Bytes ``[start, stop)`` of the chunk into the same range of ``out`` (uint8, the
        chunk's size), against the same range of ``base`` (a delta's base; the default is
        ``out`` itself, holding the base's bytes: decoded in place). ``start`` is a multiple
        of the element size."""
        if self.predictor != pr.NONE and base is None:
            base = out
        width, kind = self.itemsize, _UINT[self.itemsize]
        first, last = start // width, min(stop, self.body) // width
        for a in range(first, last, BLOCK):  # block by block: scratch memory is a block's
            b = min(last, a + BLOCK)
            elems = out[a * width : b * width].view(kind)
            planes = [plane[a:b] for plane in self.planes]
            if self.predictor == pr.NONE:
                from_planes(planes, elems)
                continue
            assert base is not None
            resid = scratch("resid", b - a, kind)
            from_planes(planes, resid)
            base_elems = base[a * width : b * width].view(kind)
            pr.unpredict(resid, base_elems, self.predictor, self.factor, out=elems)
        if stop > self.body:  # the tail bytes are stored raw
            at = max(start, self.body)
            out[at:stop] = self.tail[at - self.body : stop - self.body]


def grouped(payload: bytes | memoryview, size: int) -> np.ndarray | None:
    """The chunk as its byte planes concatenated — the grouped domain of
    :func:`~.bytes.group_bytes` — when the payload is standalone or an XOR delta without tail
    bytes: the links of an XOR chain then combine by XOR of their planes, and the chain is
    ungrouped once. None for the arithmetic predictors.

    Raises:
        ValueError: a malformed payload, or one of another size.
    """
    h = header(payload)
    if int(h["size"]) != size:
        raise ValueError(f"payload holds {h['size']} bytes, expected {size}")
    if h["predictor"] not in (pr.NONE, pr.XOR) or h["tail"]:
        return None
    planes, _ = _read_planes(payload, h)
    out = np.empty(size, dtype=np.uint8)
    if size:
        grid = out.reshape(int(h["itemsize"]), -1)
        for k, plane in enumerate(planes):
            grid[k] = plane
    return out


def _checked(payload: bytes | memoryview, delta: bool) -> dict[str, int | float]:
    """The header of a payload stored under a standalone (``delta`` False) or delta kind.

    Raises:
        ValueError: a malformed header, or a payload of the other kind.
    """
    h = header(payload)
    if delta and h["predictor"] == pr.NONE:
        raise ValueError("a delta chunk holds a standalone payload")
    if not delta and h["predictor"] != pr.NONE:
        raise ValueError("a standalone chunk holds a delta payload")
    return h


class Planes(Codec):
    """Byte planes of the chunk, each zstd-compressed when that shrinks it."""

    kind = "p"
    delta = False

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        return encode(raw, None, width, level=level, predictor=pr.NONE)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        _checked(payload, self.delta)
        decode_into(payload, out, base)

    def foldable(self, payload: bytes | memoryview) -> bool:
        h = _checked(payload, self.delta)
        return h["predictor"] in (pr.NONE, pr.XOR) and not h["tail"]

    def planes(self, payload: bytes | memoryview, size: int) -> np.ndarray | None:
        _checked(payload, self.delta)
        return grouped(payload, size)

    def blocks(self, payload: bytes | memoryview, size: int) -> Blocks:
        return Blocks(payload, size, _checked(payload, self.delta))


class PlanesDelta(Planes):
    """The residual of a predictor against the base chunk, in byte planes like :class:`Planes`;
    None (declined) when coding the chunk standalone is smaller on the sample."""

    kind = "pd"
    needs_base = True
    standalone = "p"
    delta = True

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        if base is None:
            return None
        if base.size != raw.size:
            raise ValueError(f"base has {base.size} bytes, chunk has {raw.size}")
        itemsize = width if width in _UINT else 1
        body = raw.size - raw.size % itemsize
        predictor, factor = choose_predictor(
            raw[:body].view(_UINT[itemsize]), base[:body].view(_UINT[itemsize]), level
        )
        if predictor == pr.NONE:
            return None
        return encode(raw, base, itemsize, level=level, predictor=predictor, factor=factor)

    def choice(self, payload: bytes | memoryview | None) -> int | None:
        """The predictor of ``payload``; ``none`` when the codec declined (standalone won)."""
        return pr.NONE if payload is None else int(header(payload)["predictor"])

    def encode_as(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int, choice: int
    ) -> bytes | memoryview | None:
        """The residual of predictor ``choice`` (no sample race); declines for ``none``. A
        choice that does not apply to this chunk (not a predictor, or ``scaled`` for 1- or
        8-byte elements) is chosen again on the sample."""
        itemsize = width if width in _UINT else 1
        if choice not in pr.NAMES or (choice == pr.SCALED and itemsize not in (2, 4)):
            return self.encode(raw, base, width=width, level=level)
        if base is None or choice == pr.NONE:
            return None
        return encode(raw, base, itemsize, level=level, predictor=choice)  # checks the base's size


PLANES = register(Planes())
PLANES_DELTA = register(PlanesDelta())
