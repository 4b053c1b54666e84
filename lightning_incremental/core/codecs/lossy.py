"""The lossy codecs for optimizer state (opt-in only, see :mod:`~..optimizer_state`): the codes of
:mod:`.quant`, their payload then coded in byte planes (:mod:`.planes`), whose zstd pass takes
another 10-25% off the 8-bit codes.

``q8`` (int8 absmax blocks), ``l8`` (log8 blocks, non-negative values) and ``b16`` (bfloat16)
apply to float32 chunks only (``width`` 4); they decline (None) any other chunk, and any chunk
holding a value their code cannot hold, which the encoder then stores losslessly.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from lightning_incremental.core.codecs import planes, quant
from lightning_incremental.core.codecs.registry import Codec, register


class Quantized(Codec):
    """Float32 values in one of :mod:`.quant`'s codes."""

    lossless = False
    code: ClassVar[str]
    itemsize: ClassVar[int] = 1  # the byte-plane width of the code's payload

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | None:
        if width != 4:
            return None
        payload = quant.encode_lossy(raw, self.code)
        if payload is None:
            return None
        return planes.encode(
            np.frombuffer(payload, dtype=np.uint8), None, self.itemsize, level=level
        )

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        size = int(planes.header(payload)["size"])
        # The largest payload of out.size bytes: int8 in blocks of one value.
        if size > 2 * out.size + 64:
            raise ValueError(f"quantized payload of {size} bytes for a chunk of {out.size}")
        inner = planes.decode_into(payload, np.empty(size, dtype=np.uint8))
        quant.decode_lossy_into(inner.data, out)


class Int8(Quantized):
    """Linear int8, one float32 scale per block of 2048 values (AdamW's ``exp_avg``)."""

    kind = "q8"
    code = "int8"


class Log8(Quantized):
    """8-bit logarithmic codes per block of 2048 values (AdamW's ``exp_avg_sq``)."""

    kind = "l8"
    code = "log8"


class BFloat16(Quantized):
    """float32 rounded to bfloat16 (nearest, ties to even)."""

    kind = "b16"
    code = "bf16"
    itemsize = 2


INT8 = register(Int8())
LOG8 = register(Log8())
BF16 = register(BFloat16())
