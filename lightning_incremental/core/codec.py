"""Chunk encoding: pure functions of bytes.

A chunk is stored either *standalone* — its bytes grouped by significance, then zstd — or as an
*XOR delta* against the same chunk of the previous checkpoint, grouped and compressed the same
way. Grouping puts byte ``k`` of every element next to each other: after a small update of a
float tensor the XOR leaves the sign/exponent plane almost all zero, which zstd then removes.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash
import zstandard

KIND_FULL = "z"
KIND_XOR = "x"
HASH_LEN = 32  # hex digits of a 128-bit hash

_local = threading.local()


def chunk_hash(data: np.ndarray | bytes | memoryview) -> str:
    """The 128-bit content hash (XXH3-128) of ``data``, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data.data if isinstance(data, np.ndarray) else data)


def group_width(itemsize: int, is_complex: bool) -> int:
    """Bytes per grouped element: the element size, or the component size for complex types."""
    width = itemsize // 2 if is_complex else itemsize
    return width if width in (1, 2, 4, 8) else 1


def group_bytes(raw: np.ndarray, width: int) -> np.ndarray:
    """Byte planes of ``raw`` (uint8): plane ``k`` holds byte ``k`` of every ``width``-byte
    element. The inverse is :func:`ungroup_bytes`."""
    if width == 1 or raw.size % width:
        return raw
    elems = raw.reshape(-1, width)
    planes = np.empty((width, elems.shape[0]), dtype=np.uint8)
    for k in range(width):
        planes[k] = elems[:, k]
    return planes.reshape(-1)


def ungroup_bytes(planes: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Write the element bytes of ``planes`` (see :func:`group_bytes`) into ``out``."""
    if width == 1 or planes.size % width:
        out[:] = planes
        return out
    grid = planes.reshape(width, -1)
    elems = out.reshape(-1, width)
    for k in range(width):
        elems[:, k] = grid[k]
    return out


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode_full(raw: np.ndarray, width: int, level: int) -> bytes:
    """Standalone encoding of ``raw`` (uint8)."""
    return _compressor(level).compress(group_bytes(raw, width).data)


def encode_xor(raw: np.ndarray, base: np.ndarray, width: int, level: int) -> bytes:
    """XOR-delta encoding of ``raw`` against ``base`` (uint8 arrays of equal length)."""
    if raw.size != base.size:
        raise ValueError(f"XOR base has {base.size} bytes, chunk has {raw.size}")
    return _compressor(level).compress(group_bytes(np.bitwise_xor(raw, base), width).data)


def encode_best(
    raw: np.ndarray, base: np.ndarray | None, width: int, level: int
) -> tuple[str, bytes]:
    """The smaller of the standalone and (when ``base`` is given) XOR encodings."""
    full = encode_full(raw, width, level)
    if base is None:
        return KIND_FULL, full
    delta = encode_xor(raw, base, width, level)
    return (KIND_XOR, delta) if len(delta) < len(full) else (KIND_FULL, full)


def decompress(blob: bytes | memoryview, size: int) -> bytes:
    """The grouped bytes of one object, exactly ``size`` of them.

    Raises:
        ValueError: not a valid zstd frame of ``size`` bytes.
    """
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from exc
    if declared != size:  # checked first: zstd would allocate whatever a frame declares
        raise ValueError(f"frame declares {declared} bytes, expected {size}")
    try:
        grouped = _decompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from exc
    if len(grouped) != size:
        raise ValueError(f"decoded to {len(grouped)} bytes, expected {size}")
    return grouped


def decode(
    blob: bytes | memoryview,
    kind: str,
    width: int,
    size: int,
    base: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one object into ``size`` raw bytes (into ``out`` when given).

    Raises:
        ValueError: the object is not a valid encoding of ``size`` bytes, or a delta lacks its
            base. Callers turn this into a ``CorruptCheckpointError`` naming the object.
    """
    if kind not in (KIND_FULL, KIND_XOR):
        raise ValueError(f"unknown chunk encoding {kind!r}")
    planes = np.frombuffer(decompress(blob, size), dtype=np.uint8)
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    ungroup_bytes(planes, width, out)
    if kind == KIND_XOR:
        if base is None or base.size != size:
            raise ValueError("XOR delta without a base of the same size")
        np.bitwise_xor(out, base, out=out)
    return out
