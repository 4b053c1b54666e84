"""The first built-in lossless codecs: byte-grouped zstd, standalone (``z``) or as an XOR delta
against the same chunk of the previous checkpoint (``x``). New saves use the byte-plane codecs
(:mod:`.planes`); these stay registered, outside the encoder's race, to read earlier checkpoints
(and a new delta may take one of their chunks as its base)."""

from __future__ import annotations

import numpy as np

from lightning_incremental.core.codecs.bytes import compress, decompress, group_bytes, ungroup_bytes
from lightning_incremental.core.codecs.registry import Codec, register


class Standalone(Codec):
    """The chunk's bytes grouped by significance, then zstd."""

    kind = "z"
    raced = False

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        return compress(group_bytes(raw, width), level)

    def planes(self, payload: bytes | memoryview, size: int) -> np.ndarray:
        return np.frombuffer(decompress(payload, size), dtype=np.uint8)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        ungroup_bytes(self.planes(payload, out.size), width, out)


class XorDelta(Standalone):
    """The XOR of the chunk and its base, grouped and compressed like :class:`Standalone`.
    XOR commutes with grouping: the planes of a chain XOR together."""

    kind = "x"
    needs_base = True

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        if base is None:
            return None
        if raw.size != base.size:
            raise ValueError(f"XOR base has {base.size} bytes, chunk has {raw.size}")
        return compress(group_bytes(np.bitwise_xor(raw, base), width), level)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        planes = self.planes(payload, out.size)
        if base is None or base.size != out.size:
            raise ValueError("XOR delta without a base of the same size")
        ungroup_bytes(planes, width, out)
        np.bitwise_xor(out, base, out=out)


STANDALONE = register(Standalone())
XOR = register(XorDelta())
