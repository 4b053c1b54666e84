"""The lossy codecs for optimizer state (opt-in only, see :mod:`~..optimizer_state`): the codes of
:mod:`.quant`, their payload then coded in byte planes (:mod:`.planes`), whose zstd pass takes
another 10-25% off the 8-bit codes.

``q8`` (int8 absmax blocks), ``l8`` (log8 blocks, non-negative values) and ``b16`` (bfloat16)
apply to float32 chunks only (``width`` 4); they decline (None) any other chunk, and any chunk
holding a value their code cannot hold, which the encoder then stores losslessly.

``l8d`` and ``b16d`` code the same chunk as ``l8`` / ``b16`` but relative to the previous
checkpoint's chunk *as it decodes* (a lossy chunk of the same code): both sides code that base
again and the payload is the byte-plane delta (:mod:`.planes`) of the codes — exact on the codes,
so the chunk decodes to the same values as its standalone form. Since encoder and decoder start
from the same decoded bytes (verified by their hash) the delta is consistent whatever the code.
It pays for slowly changing second moments (``exp_avg_sq``: ``beta2 = 0.999``), whose codes
barely move between checkpoints.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from lightning_incremental.core.codecs import planes, quant
from lightning_incremental.core.codecs import predict as pr
from lightning_incremental.core.codecs.registry import Codec, register


class Quantized(Codec):
    """Float32 values in one of :mod:`.quant`'s codes."""

    lossless = False
    code: ClassVar[str]
    itemsize: ClassVar[int] = 1  # the byte-plane width of the code's payload

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
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


class QuantizedDelta(Codec):
    """The codes of a chunk as a byte-plane delta against the codes of its decoded base; None
    (declined) when the base cannot be coded or the delta does not beat coding the codes
    alone."""

    lossless = False
    needs_base = True
    code: ClassVar[str]
    itemsize: ClassVar[int] = 1

    def _base_codes(self, base: np.ndarray | None, size: int) -> np.ndarray | None:
        if base is None or base.size != size:
            return None
        payload = quant.encode_lossy(base, self.code)
        return None if payload is None else np.frombuffer(payload, dtype=np.uint8)

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        if width != 4:
            return None
        payload = quant.encode_lossy(raw, self.code)
        ref = self._base_codes(base, raw.size)
        if payload is None or ref is None or len(payload) != ref.size:
            return None
        codes = np.frombuffer(payload, dtype=np.uint8)
        items = self.itemsize
        body = codes.size - codes.size % items
        uint = {1: np.uint8, 2: np.uint16}[items]
        predictor, factor = planes.choose_predictor(
            codes[:body].view(uint), ref[:body].view(uint), level
        )
        if predictor == pr.NONE:
            return None
        return planes.encode(codes, ref, items, level=level, predictor=predictor, factor=factor)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        ref = self._base_codes(base, out.size)
        if ref is None:
            raise ValueError("a quantized delta without a base its code can hold")
        if int(planes.header(payload)["size"]) != ref.size:
            raise ValueError("quantized delta of another size than its base's codes")
        inner = planes.decode_into(payload, np.empty(ref.size, dtype=np.uint8), ref)
        quant.decode_lossy_into(inner.data, out)


class Log8Delta(QuantizedDelta):
    """``l8`` codes relative to the codes of the decoded base chunk."""

    kind = "l8d"
    code = "log8"
    standalone = "l8"


class BFloat16Delta(QuantizedDelta):
    """``b16`` values relative to the decoded base chunk."""

    kind = "b16d"
    code = "bf16"
    itemsize = 2
    standalone = "b16"


INT8 = register(Int8())
LOG8 = register(Log8())
BF16 = register(BFloat16())
LOG8_DELTA = register(Log8Delta())
BF16_DELTA = register(BFloat16Delta())
