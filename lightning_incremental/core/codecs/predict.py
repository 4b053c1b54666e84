"""Predictors of a chunk from the same chunk of the previous checkpoint: pure functions on element
arrays (unsigned integers of the element width), used by the byte-plane codec (:mod:`.planes`).

* ``xor``: bit patterns XORed.
* ``sub``: bit patterns subtracted as integers (wrapping), then zigzag-mapped so that small
  negative and positive differences both have zero high bytes. For weights after a small update
  it beats XOR: a carry across a byte boundary no longer flips the upper bytes.
* ``scaled``: ``sub`` against ``factor * base`` computed as floats — one factor per chunk, for a
  tensor that decays geometrically between checkpoints (AdamW's ``exp_avg_sq``: ``beta2**k``).

All but ``scaled`` is integer arithmetic on bit patterns, and ``scaled`` is exact IEEE
arithmetic (see :func:`scaled_prediction`): decoding is bit-exact on every platform.
"""

from __future__ import annotations

import numpy as np

from lightning_incremental.core.codecs.bytes import scratch

NONE, XOR, SUB, SCALED = 0, 1, 2, 3
NAMES = {NONE: "none", XOR: "xor", SUB: "sub", SCALED: "scaled"}
INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapped differences (unsigned) to unsigned ints with small magnitudes first:
    0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (in place; returns ``d``)."""
    s = d.view(INT[d.itemsize])
    sign = np.right_shift(s, 8 * d.itemsize - 1, out=scratch("sign", s.size, s.dtype))
    np.left_shift(s, 1, out=s)
    np.bitwise_xor(s, sign, out=s)
    return d


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`, in place."""
    s = z.view(INT[z.itemsize])
    low = np.bitwise_and(z, 1, out=scratch("low", z.size, z.dtype)).view(s.dtype)
    np.right_shift(z, 1, out=z)  # logical shift: z is unsigned
    np.negative(low, out=low)  # 0 -> 0, 1 -> all ones
    np.bitwise_xor(s, low, out=s)
    return z


def scaled_prediction(base: np.ndarray, factor: float, out: np.ndarray | None = None) -> np.ndarray:
    """``factor * base`` as bit patterns of the same float format (float32 for 4-byte elements,
    bfloat16 for 2-byte ones), into ``out`` when given (else a new array).

    Bit-exact on every IEEE platform, whatever its subnormal mode: only bases that are finite
    and far from the subnormal range are scaled (``factor`` is within [1/2, 2], so the product
    is normal too: a correctly rounded float32 multiply), the others predict themselves.
    bfloat16 bases are widened to float32 exactly and the product rounded back to nearest-even
    in integer arithmetic.

    Raises:
        ValueError: ``factor`` outside [1/2, 2], or elements that are not 2 or 4 bytes.
    """
    if not 0.5 <= factor <= 2.0:
        raise ValueError(f"scale factor {factor} outside [0.5, 2]")
    if base.itemsize not in (2, 4):
        raise ValueError("the scaled predictor needs 2- or 4-byte floats")
    pred = np.empty_like(base) if out is None else out
    # Unusable: a biased exponent outside [3, 252]. The magnitude's bits minus those of the
    # smallest usable exponent, wrapping, are then at least the width of the usable range
    # (smaller exponents wrap around to large values).
    shift = 23 if base.itemsize == 4 else 7
    sign_off = base.dtype.type((1 << (8 * base.itemsize - 1)) - 1)
    magnitude = np.bitwise_and(base, sign_off, out=scratch("mag", base.size, base.dtype))
    np.subtract(magnitude, base.dtype.type(3 << shift), out=magnitude)
    unusable = np.greater_equal(
        magnitude, base.dtype.type(250 << shift), out=scratch("unusable", base.size, np.bool_)
    )
    if base.itemsize == 4:
        with np.errstate(over="ignore", invalid="ignore"):  # unusable lanes: replaced below
            np.multiply(base.view(np.float32), np.float32(factor), out=pred.view(np.float32))
    else:  # widen exactly, scale, round to nearest-even: + 0x7FFF + the kept part's lowest bit
        wide = scratch("wide", base.size, np.uint32)
        np.copyto(wide, base)
        np.left_shift(wide, 16, out=wide)
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(wide.view(np.float32), np.float32(factor), out=wide.view(np.float32))
        odd = np.right_shift(wide, 16, out=scratch("odd", base.size, np.uint32))
        np.bitwise_and(odd, np.uint32(1), out=odd)
        np.add(odd, np.uint32(0x7FFF), out=odd)
        np.add(wide, odd, out=wide)
        np.right_shift(wide, 16, out=wide)
        np.copyto(pred, wide, casting="unsafe")
    if unusable.any():  # a widened bfloat16 rounds back to itself: replace after rounding
        np.copyto(pred, base, where=unusable)
    return pred


SCALE_SAMPLE = 2048  # elements the scale factor is estimated on: its median settles long before


def estimate_scale(elems: np.ndarray, base: np.ndarray) -> float:
    """The median ratio ``elems / base`` of a float32/bfloat16 sample (at most ``SCALE_SAMPLE``
    elements of it, evenly spaced), clamped to [1/2, 2] and rounded to float32 (as stored)."""
    step = max(1, elems.size // SCALE_SAMPLE)
    elems, base = elems[::step], base[::step]
    if elems.itemsize == 2:
        e = (elems.astype(np.uint32) << 16).view(np.float32)
        b = (base.astype(np.uint32) << 16).view(np.float32)
    else:
        e, b = elems.view(np.float32), base.view(np.float32)
    with np.errstate(all="ignore"):
        ratio = e.astype(np.float64) / b
    ratio = ratio[np.isfinite(ratio)]
    if not ratio.size:
        return 1.0
    middle = ratio.size // 2
    ratio.partition((middle - 1, middle) if ratio.size % 2 == 0 else middle)
    median = ratio[middle] if ratio.size % 2 else (ratio[middle - 1] + ratio[middle]) / 2
    return float(np.float32(min(2.0, max(0.5, float(median)))))


def predict(
    elems: np.ndarray,
    base: np.ndarray | None,
    predictor: int,
    factor: float = 1.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The residual of ``elems`` against ``base``, into ``out`` when given (else a new array;
    ``elems`` is not modified).

    Raises:
        ValueError: an unknown predictor, or one that needs a base without one.
    """
    if predictor not in NAMES:
        raise ValueError(f"unknown predictor {predictor}")
    if predictor != NONE and base is None:
        raise ValueError(f"predictor {NAMES[predictor]!r} needs a base")
    resid = np.empty_like(elems) if out is None else out
    if predictor == NONE:
        np.copyto(resid, elems)
        return resid
    assert base is not None
    if predictor == XOR:
        return np.bitwise_xor(elems, base, out=resid)
    if predictor == SUB:
        return zigzag(np.subtract(elems, base, out=resid))
    scaled_prediction(base, factor, out=resid)
    return zigzag(np.subtract(elems, resid, out=resid))


def unpredict(
    resid: np.ndarray,
    base: np.ndarray | None,
    predictor: int,
    factor: float = 1.0,
    out: np.ndarray | None = None,
) -> None:
    """Turn ``resid`` back into the elements: into ``out`` when given (which may be ``base``
    itself: a chain decoded in place), else in place. ``resid`` is modified either way.

    Raises:
        ValueError: an unknown predictor, or a base missing or of another size.
    """
    into = resid if out is None else out
    if predictor == NONE:
        if into is not resid:
            np.copyto(into, resid)
        return
    if base is None or base.size != resid.size:
        raise ValueError(f"predictor {NAMES.get(predictor, predictor)!r} needs a base")
    if predictor == XOR:
        np.bitwise_xor(resid, base, out=into)
    elif predictor == SUB:
        np.add(unzigzag(resid), base, out=into)
    elif predictor == SCALED:
        prediction = scratch("prediction", base.size, base.dtype)
        np.add(unzigzag(resid), scaled_prediction(base, factor, out=prediction), out=into)
    else:
        raise ValueError(f"unknown predictor {predictor}")
