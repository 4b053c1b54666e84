"""The engine: chunked, content-addressed, delta-encoded checkpoints on any fsspec URL.

Framework-free: imports torch, numpy, fsspec and zstandard, never lightning or accelerate, nor
the distributed runtime built on it (:mod:`lightning_incremental.runtime`).
"""

from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FencedError,
    FormatVersionError,
    ManifestError,
    NotAStoreError,
    NotDurableError,
    PickleNotAllowedError,
    StepError,
    StepTypeError,
    StorageError,
    StoreNotWritableError,
    UnsupportedValueError,
    WriterLeaseError,
)
from lightning_incremental.core.results import GcReport, SaveResult, VerifyReport
from lightning_incremental.core.save.queue import SaveHandle
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.store import CheckpointStore

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "ConfigError",
    "CorruptCheckpointError",
    "FencedError",
    "FormatVersionError",
    "GcReport",
    "ManifestError",
    "NotAStoreError",
    "NotDurableError",
    "PickleNotAllowedError",
    "SaveHandle",
    "SaveResult",
    "StepError",
    "StepTypeError",
    "Storage",
    "StorageError",
    "StoreConfig",
    "StoreNotWritableError",
    "UnsupportedValueError",
    "VerifyReport",
    "WriterLeaseError",
]
