"""lightning-incremental: incremental checkpointing and failure recovery for PyTorch training.

Layers, lowest first: the engine (:mod:`lightning_incremental.core`), the framework-free runtime
(:mod:`lightning_incremental.runtime`), and the adapters — Lightning's in
:mod:`lightning_incremental.lightning`, Accelerate's in :mod:`accelerate_incremental` — beside
the ``lightning-incremental`` command (:mod:`lightning_incremental.cli`). The Lightning names
below are imported lazily (PEP 562), so ``import lightning_incremental`` does not load Lightning;
type checkers see the real classes through the ``TYPE_CHECKING`` block.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_incremental._version import __version__
from lightning_incremental.core import CheckpointStore, StoreConfig

if TYPE_CHECKING:
    from lightning_incremental.lightning.callback import IncrementalCheckpoint
    from lightning_incremental.lightning.checkpoint_io import IncrementalCheckpointIO
    from lightning_incremental.lightning.loading import load_from_checkpoint

_LAZY: dict[str, str] = {
    "IncrementalCheckpoint": "lightning_incremental.lightning.callback",
    "IncrementalCheckpointIO": "lightning_incremental.lightning.checkpoint_io",
    "load_from_checkpoint": "lightning_incremental.lightning.loading",
}

__all__ = [
    "CheckpointStore",
    "IncrementalCheckpoint",
    "IncrementalCheckpointIO",
    "StoreConfig",
    "__version__",
    "load_from_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_incremental' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
