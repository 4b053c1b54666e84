"""The module a pointer file's first bytes name (``clightning_incremental._pointers``).

Part of the pointer file format (:mod:`lightning_incremental.lightning.pointers`): every pointer
file ever written calls ``lightning_incremental._pointers.not_a_torch_checkpoint`` when
``torch.load`` unpickles it, so the name stays where it was when the adapter moved.
"""

from lightning_incremental.lightning.pointers import (
    NotATorchCheckpointError,
    not_a_torch_checkpoint,
)

__all__ = ["NotATorchCheckpointError", "not_a_torch_checkpoint"]
