"""Hugging Face Accelerate integration of lightning-incremental.

A thin adapter over :mod:`lightning_incremental.core`; importing it never imports Lightning (nor
Accelerate: it is imported when a checkpointer is created for an accelerator).

* :class:`IncrementalCheckpointer` — save/load the whole ``Accelerator`` training state
  incrementally, one global commit per checkpoint.
* :func:`enable` — the launch flag (``ACCELERATE_INCREMENTAL=dir accelerate launch ...``): routes
  ``accelerator.save_state`` / ``load_state`` through the engine.
"""

from __future__ import annotations

from accelerate_incremental._flag import ENV_CONFIG, ENV_DIR, enable
from accelerate_incremental.checkpointer import IncrementalCheckpointer
from lightning_incremental._version import __version__

__all__ = ["ENV_CONFIG", "ENV_DIR", "IncrementalCheckpointer", "__version__", "enable"]
