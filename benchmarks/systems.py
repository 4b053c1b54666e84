"""Checkpointing systems measured side by side on the same states.

Each system saves a state (``save`` returns when the checkpoint is durable, measuring how long
the caller was blocked and how long until durable) and restores the newest checkpoint it wrote.
Adding a baseline is a new ``System`` subclass registered with ``@system``.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch


@dataclass
class SaveStats:
    stall_s: float  # the caller (the training loop) was blocked this long
    save_s: float  # from the call until the checkpoint is durable (or at least written)
    bytes_written: int
    extra: dict[str, Any] = field(default_factory=dict)


class System(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for ``--list``
    fsync: ClassVar[bool]  # whether a finished save is fsynced to disk

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        self.root = root
        self.options = options
        root.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        """Save ``state`` as checkpoint number ``checkpoint``; return once it is durable."""

    @abstractmethod
    def restore(self) -> Any:
        """Load the newest checkpoint, as a fresh process resuming training would."""

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Wait for and release whatever the system still holds."""


SYSTEMS: dict[str, type[System]] = {}


def system(cls: type[System]) -> type[System]:
    SYSTEMS[cls.name] = cls
    return cls


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FileSystem(System):
    """A baseline writing one ``torch.save`` file per checkpoint."""

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        self.newest: Path | None = None

    def path(self, checkpoint: int) -> Path:
        return self.root / f"checkpoint-{checkpoint:04d}.pt"

    def restore(self) -> Any:
        assert self.newest is not None
        return torch.load(self.newest, map_location="cpu", weights_only=True)


@system
class TorchSave(_FileSystem):
    """``torch.save`` to a local file, then fsync (blocking: stall = save time)."""

    name = "torch_save"
    summary = "torch.save to a local file + fsync; blocks for the whole save"
    fsync = True

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.path(checkpoint)
        start = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(self.root)
        elapsed = time.perf_counter() - start
        self.newest = path
        return SaveStats(elapsed, elapsed, path.stat().st_size)


@system
class LightningAsync(_FileSystem):
    """Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``: clones every tensor on the caller's
    thread, then ``torch.save`` to an in-memory buffer and writes the file in one background
    thread. Lightning does not fsync. ``save_s`` ends when ``teardown()`` (which joins the
    background thread and re-raises its error) returns."""

    name = "lightning_async"
    summary = "Lightning AsyncCheckpointIO(TorchCheckpointIO()): clone, then save in a thread"
    fsync = False

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.path(checkpoint)
        start = time.perf_counter()
        self.io.save_checkpoint(state, path)
        stall = time.perf_counter() - start
        self.io.teardown()  # waits for the background save
        elapsed = time.perf_counter() - start
        self.newest = path
        return SaveStats(stall, elapsed, path.stat().st_size)

    def close(self) -> None:
        self.io.teardown()


@system
class Incremental(System):
    """lightning-incremental's ``CheckpointStore`` on a local directory (fsync on)."""

    name = "incremental"
    summary = "lightning-incremental CheckpointStore on a local directory (fsync on)"
    fsync = True

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        from lightning_incremental.core import CheckpointStore

        self._open: Callable[[], Any] = lambda: CheckpointStore(str(root / "store"), **options)
        self.store = self._open()

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        start = time.perf_counter()
        handle = self.store.save(state, checkpoint, metadata={"global_step": step})
        stall = time.perf_counter() - start
        result = handle.wait()
        background_s = result.total_s - result.snapshot_s
        extra = {
            "snapshot_s": result.snapshot_s,
            "wait_s": result.wait_s,
            "encode_s": result.encode_s,
            "write_s": result.write_s,
            "total_s": result.total_s,
            "background_s": background_s,
            "full_base": result.full_base,
            "chunks_total": result.chunks_total,
            "chunks_reused": result.chunks_reused,
            "chunks_delta": result.chunks_delta,
            "chunks_full": result.chunks_full,
            "compression_ratio": result.ratio,
            # Bytes of state per second of (summed) encode work: XOR, byte grouping, zstd.
            "encode_MBps": _mbps(result.bytes_logical, result.encode_s),
            # Bytes of state per second of wall time after the snapshot: hashing, encoding,
            # writing and fsync, as the background pipeline achieved them.
            "pipeline_MBps": _mbps(result.bytes_logical, background_s),
        }
        return SaveStats(stall, result.total_s, result.bytes_written, extra)

    def restore(self) -> Any:
        store = self._open()
        try:
            return store.load()
        finally:
            store.close()

    def close(self) -> None:
        self.store.close()


def _mbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e6 if seconds > 0 else None
