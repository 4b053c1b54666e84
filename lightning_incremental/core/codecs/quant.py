"""Lossy codes for optimizer state: block-wise 8-bit quantization and bf16 rounding.

Pure, vectorised functions (numpy). Decoding is bit-stable: an int8 value is ``code * scale``
computed exactly in float64 (an 8-bit code times a float32 scale has at most 32 significant
bits) and rounded once to float32; a log8 value is integer arithmetic on bit patterns; bf16 is
exact widening. The store verifies every decoded chunk against the hash recorded at save time
all the same.

Codes:

* ``int8`` — linear absmax: ``q = rint(x / absmax * 127)`` in -127..127, one float32 scale
  (``absmax / 127``) per block of ``DEFAULT_BLOCK`` values. For values of one order of magnitude
  in a block: AdamW's ``exp_avg``.
* ``log8`` — 8-bit codes of the float32 bit pattern, a piecewise-linear log2: a uniform relative
  precision over each block's range, for non-negative values spanning many decades
  (``exp_avg_sq``). Linear int8 is unusable there: small values would round to 0 and the Adam
  step ``m / (sqrt(v) + eps)`` would become ``m / eps``.
* ``bf16`` — float32 rounded to bfloat16 (round to nearest, ties to even).

Each code is idempotent on its own output: coding decoded values again gives the same codes.
A value the code cannot hold (NaN, infinity, a negative value for log8) makes the encoder return
None: the caller then stores the chunk losslessly.
"""

from __future__ import annotations

import struct

import numpy as np

DEFAULT_BLOCK = 2048


# --- linear absmax int8 -----------------------------------------------------------------------


def _blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """``x`` (float32, 1-d) padded with zeros to whole blocks, as ``(nblocks, block)``."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    n = x.size
    nblocks = -(-n // block)
    if nblocks * block == n:
        return x.reshape(nblocks, block), n
    padded = np.zeros(nblocks * block, dtype=np.float32)
    padded[:n] = x
    return padded.reshape(nblocks, block), n


def _absmax(grid: np.ndarray) -> np.ndarray | None:
    absmax = np.max(np.abs(grid), axis=1) if grid.size else np.zeros(0, np.float32)
    if not np.all(np.isfinite(absmax)):
        return None
    return absmax.astype(np.float32)


def quantize_int8_blockwise(
    x: np.ndarray, block: int = DEFAULT_BLOCK
) -> tuple[np.ndarray, np.ndarray] | None:
    """Linear absmax quantization of float32 ``x``: ``(codes int8[n], scales float32[nblocks])``
    with ``x ≈ codes * scales[block]``; ``None`` when ``x`` holds a NaN or an infinity."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    grid, n = _blocks(x, block)
    absmax = _absmax(grid)
    if absmax is None:
        return None
    scales = (absmax / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float64)
    q = np.rint(grid.astype(np.float64) / safe[:, None])
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8).reshape(-1)[:n], scales


def dequantize_int8_blockwise(
    codes: np.ndarray, scales: np.ndarray, block: int = DEFAULT_BLOCK, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`quantize_int8_blockwise` (float32; into ``out`` when given)."""
    n = codes.size
    if scales.size != -(-n // block):
        raise ValueError(f"{scales.size} scales for {n} codes in blocks of {block}")
    per = np.repeat(scales.astype(np.float64), block)[:n]
    values = codes.astype(np.float64) * per
    if out is None:
        return values.astype(np.float32)
    out[...] = values
    return out


# --- log8: 8-bit codes of the float32 bit pattern (a piecewise-linear log2) ------------------


def quantize_log8_blockwise(
    v: np.ndarray, block: int = DEFAULT_BLOCK, max_binades: int = 40
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Quantize non-negative float32 ``v`` (e.g. ``exp_avg_sq``) on a logarithmic scale, all in
    integer arithmetic: the bit pattern of a positive float32 is a piecewise-linear log2 of it.

    Per block: ``lo`` = the smallest positive bit pattern (but at most ``max_binades`` binades
    below the largest), ``span`` = largest - ``lo``; code 0 is exact zero, codes 1..255 are
    ``lo + round((bits - lo) * 254 / span)``: a uniform relative precision over the block's
    range (6 decades: <= 2.8%). Values below the floor round up to it, never to zero (a smaller
    Adam step, never a larger one). Returns ``(codes uint8[n], lo uint32[nb], span uint32[nb])``,
    ``None`` for a negative or non-finite value."""
    x = np.asarray(v, dtype=np.float32).reshape(-1)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    bits = x.view(np.uint32)
    negative = bits > np.uint32(0x80000000)  # -0.0 is allowed (coded as 0)
    non_finite = (bits & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000)
    if np.any(negative | non_finite):
        return None
    n = x.size
    nb = -(-n // block)
    flat_grid = np.zeros(nb * block, dtype=np.int32)  # patterns of values >= 0 fit in int32
    flat_grid[:n] = bits.view(np.int32)
    np.maximum(flat_grid, 0, out=flat_grid)  # -0.0 (the only negative pattern left) -> +0.0
    grid = flat_grid.reshape(nb, block)
    hi = grid.max(axis=1).astype(np.int64) if n else np.zeros(0, np.int64)
    positive = np.where(grid > 0, grid, np.int32(0x7FFFFFFF))
    lo = positive.min(axis=1).astype(np.int64) if n else hi
    lo = np.maximum(np.minimum(lo, hi), hi - np.int64(max_binades) * (1 << 23))
    lo = np.maximum(lo, 1)
    span = np.maximum(hi - lo, 0)
    # The code of each value: the nearest grid point. float32 suffices: only decode must be
    # exact, and it is integer arithmetic on the stored codes.
    step = np.where(span > 0, 254.0 / np.maximum(span, 1), 0.0).astype(np.float32)
    off = grid - lo.astype(np.int32)[:, None]
    np.maximum(off, 0, out=off)
    qf = off.astype(np.float32)
    qf *= step[:, None]
    qf += np.float32(1.5)  # +1: code 0 is zero; +0.5 and truncation: round half up
    codes = qf.astype(np.uint8)
    codes[grid == 0] = 0
    return codes.reshape(-1)[:n], lo.astype(np.uint32), span.astype(np.uint32)


def dequantize_log8_blockwise(
    codes: np.ndarray,
    lo: np.ndarray,
    span: np.ndarray,
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Inverse of :func:`quantize_log8_blockwise`: integer arithmetic only (bit-stable)."""
    n = codes.size
    nb = -(-n // block)
    if lo.size != nb or span.size != nb:
        raise ValueError(f"{lo.size}/{span.size} block parameters for {n} codes of {block}")
    # One 256-entry table of bit patterns per block, then a gather: the integer formula runs
    # 256 times per block instead of once per value.
    if nb * 256 >= 1 << 31:
        raise ValueError("too many blocks")
    c = np.arange(256, dtype=np.int64)
    table = lo.astype(np.int64)[:, None] + ((c - 1) * span.astype(np.int64)[:, None] + 127) // 254
    table[:, 0] = 0
    if table.size and table.max() >= 0x7F800000:
        raise ValueError("log8 parameters outside the finite float32 range")
    flat = table.astype(np.uint32).reshape(-1)
    idx = np.zeros(nb * block, dtype=np.int32)
    idx[:n] = codes
    idx.reshape(nb, block)[...] += (np.arange(nb, dtype=np.int32) * 256)[:, None]
    bits = flat.take(idx[:n])
    values = bits.view(np.float32)
    if out is None:
        return values
    out[...] = values
    return out


# --- bf16 ---------------------------------------------------------------------------------------


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even; NaN stays a
    (quiet) NaN of the same sign, infinities stay infinite."""
    bits = np.asarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def bf16_to_float32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- payloads: float32 bytes in, self-describing payload out ---------------------------------

MAGIC = b"LQZ1"
MAX_BLOCK = 1 << 16
_HEAD = struct.Struct("<4sBBIQ")  # magic, code, (reserved), block, element count
_CODES = {"int8": 1, "bf16": 3, "log8": 4}
_NAMES = {v: k for k, v in _CODES.items()}


def encode_lossy(raw: np.ndarray, code: str, block: int = DEFAULT_BLOCK) -> bytes | None:
    """The payload of a chunk of float32 values (``raw``, uint8) in ``code`` (``int8``, ``log8``
    or ``bf16``); None when the chunk cannot be coded that way: not whole float32 values, a
    non-finite value, or a negative one for ``log8`` (the caller then stores it losslessly).

    Raises:
        ValueError: an unknown code or a bad block size.
    """
    if code not in _CODES:
        raise ValueError(f"unknown code {code!r}")
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block must be in 1..{MAX_BLOCK}, got {block}")
    if raw.size % 4:
        return None
    x = raw.view(np.float32)
    if code == "bf16":
        if not np.all(np.isfinite(x)):
            return None
        return _HEAD.pack(MAGIC, _CODES[code], 0, 0, x.size) + float32_to_bf16(x).tobytes()
    head = _HEAD.pack(MAGIC, _CODES[code], 0, block, x.size)
    if code == "log8":
        res8 = quantize_log8_blockwise(x, block)
        if res8 is None:
            return None
        codes, lo, span = res8
        return head + lo.astype("<u4").tobytes() + span.astype("<u4").tobytes() + codes.tobytes()
    res = quantize_int8_blockwise(x, block)
    if res is None:
        return None
    codes, scales = res
    return head + scales.astype("<f4").tobytes() + codes.tobytes()


def decode_lossy_into(payload: bytes | memoryview, out: np.ndarray) -> np.ndarray:
    """Decode an :func:`encode_lossy` payload into ``out`` (uint8, 4 bytes per value).

    Raises:
        ValueError: not a valid payload of ``out.size // 4`` values.
    """
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise ValueError("payload shorter than its header")
    magic, code, _, block, n = _HEAD.unpack_from(view)
    if magic != MAGIC or code not in _NAMES:
        raise ValueError("not a quantized payload")
    if out.size != 4 * n:
        raise ValueError(f"payload holds {n} values, out has {out.size} bytes")
    dest = out.view(np.float32)
    body = view[_HEAD.size :]
    if _NAMES[code] == "bf16":
        if len(body) != 2 * n:
            raise ValueError("bf16 payload of the wrong length")
        dest[:] = bf16_to_float32(np.frombuffer(body, dtype="<u2"))
        return out
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError("bad block size")
    nblocks = -(-n // block)
    if _NAMES[code] == "log8":
        if len(body) != 8 * nblocks + n:
            raise ValueError("log8 payload of the wrong length")
        lo = np.frombuffer(body[: 4 * nblocks], dtype="<u4")
        span = np.frombuffer(body[4 * nblocks : 8 * nblocks], dtype="<u4")
        codes8 = np.frombuffer(body[8 * nblocks :], dtype=np.uint8)
        dequantize_log8_blockwise(codes8, lo, span, block, out=dest)
        return out
    if len(body) != 4 * nblocks + n:
        raise ValueError("int8 payload of the wrong length")
    scales = np.frombuffer(body[: 4 * nblocks], dtype="<f4")
    if not np.all(np.isfinite(scales)):
        raise ValueError("int8 payload with a non-finite scale")
    codes = np.frombuffer(body[4 * nblocks :], dtype=np.int8)
    dequantize_int8_blockwise(codes, scales, block, out=dest)
    return out
