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

NONE, XOR, SUB, SCALED = 0, 1, 2, 3
NAMES = {NONE: "none", XOR: "xor", SUB: "sub", SCALED: "scaled"}
INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapped differences (unsigned) to unsigned ints with small magnitudes first:
    0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (in place; returns ``d``)."""
    s = d.view(INT[d.itemsize])
    sign = s >> (8 * d.itemsize - 1)
    np.left_shift(s, 1, out=s)
    np.bitwise_xor(s, sign, out=s)
    return d


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`, in place."""
    s = z.view(INT[z.itemsize])
    low = (z & 1).view(INT[z.itemsize])
    np.right_shift(z, 1, out=z)  # logical shift: z is unsigned
    np.negative(low, out=low)  # 0 -> 0, 1 -> all ones
    np.bitwise_xor(s, low, out=s)
    return z


def scaled_prediction(base: np.ndarray, factor: float) -> np.ndarray:
    """``factor * base`` as bit patterns of the same float format (float32 for 4-byte elements,
    bfloat16 for 2-byte ones).

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
    if base.itemsize == 4:
        bits = base
    elif base.itemsize == 2:
        bits = base.astype(np.uint32) << 16
    else:
        raise ValueError("the scaled predictor needs 2- or 4-byte floats")
    # Usable: biased exponent in [3, 252]. The magnitude's bits minus 3 << 23, wrapping, fall
    # below 250 << 23 exactly then (smaller exponents wrap around to large values).
    unusable = np.bitwise_and(bits, np.uint32(0x7FFFFFFF))
    np.subtract(unusable, np.uint32(3 << 23), out=unusable)
    unusable = np.greater_equal(unusable, np.uint32(250 << 23))
    with np.errstate(over="ignore", invalid="ignore"):  # unusable lanes: replaced below
        pred = np.multiply(bits.view(np.float32), np.float32(factor)).view(np.uint32)
    np.copyto(pred, bits, where=unusable)
    if base.itemsize == 2:
        pred = ((pred + (np.uint32(0x7FFF) + ((pred >> 16) & 1))) >> 16).astype(np.uint16)
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
    return float(np.float32(np.clip(median, 0.5, 2.0)))


def predict(
    elems: np.ndarray, base: np.ndarray | None, predictor: int, factor: float = 1.0
) -> np.ndarray:
    """The residual of ``elems`` against ``base`` (a new array; ``elems`` is not modified).

    Raises:
        ValueError: an unknown predictor, or one that needs a base without one.
    """
    if predictor == NONE:
        return elems.copy()
    if base is None:
        raise ValueError(f"predictor {NAMES.get(predictor, predictor)!r} needs a base")
    if predictor == XOR:
        return np.bitwise_xor(elems, base)
    if predictor == SUB:
        return zigzag(np.subtract(elems, base))
    if predictor == SCALED:
        return zigzag(np.subtract(elems, scaled_prediction(base, factor)))
    raise ValueError(f"unknown predictor {predictor}")


def unpredict(
    resid: np.ndarray, base: np.ndarray | None, predictor: int, factor: float = 1.0
) -> None:
    """Turn ``resid`` back into the elements, in place.

    Raises:
        ValueError: an unknown predictor, or a base missing or of another size.
    """
    if predictor == NONE:
        return
    if base is None or base.size != resid.size:
        raise ValueError(f"predictor {NAMES.get(predictor, predictor)!r} needs a base")
    if predictor == XOR:
        np.bitwise_xor(resid, base, out=resid)
    elif predictor == SUB:
        np.add(unzigzag(resid), base, out=resid)
    elif predictor == SCALED:
        np.add(unzigzag(resid), scaled_prediction(base, factor), out=resid)
    else:
        raise ValueError(f"unknown predictor {predictor}")
