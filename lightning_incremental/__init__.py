"""lightning-incremental: incremental checkpointing and failure recovery for PyTorch training.

The engine lives in :mod:`lightning_incremental.core`. Framework adapters are imported lazily
(PEP 562), so ``import lightning_incremental.core`` and ``import accelerate_incremental`` never
load Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_incremental._version import __version__
from lightning_incremental.core import CheckpointStore, StoreConfig

_LAZY: dict[str, str] = {
    "IncrementalCheckpoint": "lightning_incremental.callback",
    "IncrementalCheckpointIO": "lightning_incremental.checkpoint_io",
    "load_from_checkpoint": "lightning_incremental.loading",
}

__all__ = ["CheckpointStore", "StoreConfig", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_incremental' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
