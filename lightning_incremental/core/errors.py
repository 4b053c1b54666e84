"""Exceptions raised by the engine.

Every error names what was wrong and, where there is one, the fix. The classes also derive from
the builtin exception a caller would naturally catch (``TypeError`` for a value that cannot be
saved, ``FileNotFoundError`` for a missing checkpoint, ``OSError`` for storage failures).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by ``lightning_incremental.core``."""


class ConfigError(CheckpointError, ValueError):
    """An invalid configuration value or argument."""


class StepError(CheckpointError, ValueError):
    """A step that is not a non-negative int, or not newer than every committed step."""


class StepTypeError(StepError, TypeError):
    """A step that is not an int at all: a :class:`StepError`, and a ``TypeError`` as Python
    raises for an argument of the wrong type."""


class UnsupportedValueError(CheckpointError, TypeError):
    """The state holds a value the store cannot save without executing code on load."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No store at the URL, an empty store, or a step that was never committed."""


class NotAStoreError(CheckpointNotFoundError):
    """The location exists but does not hold a checkpoint store."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint cannot be restored bit-exactly: a missing, truncated or corrupt
    object, or a manifest that does not validate."""


class ManifestError(CorruptCheckpointError):
    """A manifest that is malformed or hostile (unknown fields, paths outside the store)."""


class FormatVersionError(CheckpointError):
    """A manifest or store written by a newer, incompatible format version."""


class PickleNotAllowedError(CheckpointError):
    """A checkpoint holds pickled objects and the store was not opened with ``allow_pickle``."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (I/O error, disk full, permission, network)."""


class NotDurableError(StorageError):
    """A write reached the storage but could not be made durable (an fsync failed): it is not
    reported done, and a save it belongs to does not commit."""


class StoreNotWritableError(StorageError):
    """A writer's check at its start (:meth:`CheckpointStore.acquire_writer`) found that this
    process cannot write the store: a read-only directory, a permission it lacks, a bucket
    without write access. It names the location and the storage's error (``errno`` is that
    error's)."""


class FencedError(CheckpointError):
    """This writer's fencing generation was superseded: a restarted job took over the store, so
    this process must stop writing (what it commits is not visible)."""


class WriterLeaseError(CheckpointError, PermissionError):
    """Another process holds the store's writer lease (one writer per store), or this process
    lost it to another writer and must stop writing."""


class DistributedSaveError(CheckpointError):
    """A distributed save did not commit because a rank failed, died or did not report within
    the store's collective timeout (the checkpoint is not visible)."""
