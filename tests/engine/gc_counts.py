"""Counting the garbage collections a block of code triggers (tests count them; never time)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def collections_started() -> Iterator[list[int]]:
    """The generation of every collection that starts inside the block, in order. Everything
    collectable is collected first, so that earlier garbage triggers none of them."""
    started: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        yield started
    finally:
        gc.callbacks.remove(count)
