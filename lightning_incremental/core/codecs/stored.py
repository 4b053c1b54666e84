"""``s``: a chunk's bytes as they are, the cheapest encoding there is (no CPU beyond the copy
into its pack).

Not raced: the encoder uses it only when asked for the least CPU (``codec_effort="fast"``, or
``"auto"`` while training keeps every core busy; see :mod:`lightning_incremental.core.config`).
A stored chunk is a standalone root like any other: later deltas may take it as their base."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_incremental.core.codecs.registry import Codec, register


class Stored(Codec):
    """The chunk's raw bytes."""

    kind = "s"
    raced = False

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> memoryview:
        return stored(raw)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        if len(payload) != out.size:
            raise ValueError(f"a stored chunk of {len(payload)} bytes, expected {out.size}")
        out[:] = np.frombuffer(payload, dtype=np.uint8)


def stored(raw: np.ndarray) -> memoryview:
    """``raw``'s bytes, not copied (they are copied into their pack)."""
    data: Any = np.ascontiguousarray(raw, dtype=np.uint8)
    return memoryview(data).cast("B")


STORED = register(Stored())
