"""Hugging Face Accelerate integration of lightning-incremental.

A thin adapter over :mod:`lightning_incremental.core`; importing it never imports Lightning (nor
Accelerate: it is imported when a checkpointer is created for an accelerator).

* :class:`IncrementalCheckpointer` — save/load the whole ``Accelerator`` training state
  incrementally, one global commit per checkpoint.
* ``accelerate launch ... -m accelerate_incremental --dirpath URL train.py`` — no edit to the
  script: every accelerator it prepares a model with saves and loads through the engine
  (``accelerator.save_state`` / ``load_state``), and plain loops over its prepared DataLoaders
  resume mid-epoch exactly.
* :func:`enable` — the same for one accelerator, from the script (with the
  ``ACCELERATE_INCREMENTAL`` environment variable, or a ``dirpath``).
* :func:`enable_trainer` — a Hugging Face ``Trainer``'s ``checkpoint-N`` saves and resumes
  through the engine, at its own cadence (the launch flag does it for every Trainer); importing
  this package never imports ``transformers``.
"""

from __future__ import annotations

from accelerate_incremental._flag import ENV_CONFIG, ENV_DIR, enable
from accelerate_incremental.checkpointer import IncrementalCheckpointer
from accelerate_incremental.trainer import enable_trainer
from lightning_incremental._version import __version__

__all__ = [
    "ENV_CONFIG",
    "ENV_DIR",
    "IncrementalCheckpointer",
    "__version__",
    "enable",
    "enable_trainer",
]
