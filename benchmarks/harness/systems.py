"""Checkpointing systems measured side by side on the same states.

Each system saves a state (``save`` returns when the checkpoint is durable, measuring how long
the caller was blocked and how long until durable) and restores the newest checkpoint it wrote.
Adding a baseline is a new ``System`` subclass registered with ``@system``. Systems that save
from the live objects rather than from the state dict (Accelerate) get them through ``attach``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from benchmarks.harness.scenarios import Workload
from benchmarks.harness.state import map_tensors


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

    def attach(self, work: Workload, rebuild: Callable[[], Workload]) -> None:  # noqa: B027
        """Called once before the first save with the live workload, and a factory of fresh ones
        (what a resuming process would build before loading). Nothing by default."""

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


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
class LightningTorch(_FileSystem):
    """Lightning's ``TorchCheckpointIO``: ``torch.save`` into an in-memory buffer, then one write
    of the file through fsspec (blocking; Lightning does not fsync)."""

    name = "lightning_torch"
    summary = "Lightning TorchCheckpointIO: torch.save to a buffer, then write; blocks"
    fsync = False

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        self.io = TorchCheckpointIO()

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.path(checkpoint)
        start = time.perf_counter()
        self.io.save_checkpoint(state, path)
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
        from lightning_incremental.core.format.canonical import forget_parsed

        # As a resuming process: manifests not already parsed (this one kept those it wrote).
        forget_parsed()
        store = self._open()
        try:
            return store.load()
        finally:
            store.close()

    def close(self) -> None:
        self.store.close()


@system
class IncrementalLightningIO(System):
    """lightning-incremental's ``IncrementalCheckpointIO`` inside a real Lightning ``Trainer``
    (``Trainer(plugins=[IncrementalCheckpointIO()])``). A save is the call
    ``trainer.save_checkpoint`` makes once it has built the checkpoint dict,
    ``trainer.strategy.save_checkpoint(state, path)``: it returns after the engine's snapshot;
    durable when the plug-in's ``wait()`` returns (committed, pointer file written). Bytes: growth
    of the directory (store + pointer). Restore: a fresh plug-in's ``load_checkpoint(path)``, the
    call behind ``fit(ckpt_path=path)``."""

    name = "incremental_io"
    summary = "IncrementalCheckpointIO in a Lightning Trainer: strategy.save_checkpoint (fsync on)"
    fsync = True

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        from lightning.pytorch import Trainer

        from lightning_incremental.lightning.checkpoint_io import IncrementalCheckpointIO

        self._plugin = lambda: IncrementalCheckpointIO(**options)
        self.plugin = self._plugin()
        quiet = logging.getLogger("lightning.pytorch")
        level = quiet.level
        quiet.setLevel(logging.WARNING)  # no "GPU available: False" banner
        try:
            self.trainer = Trainer(
                plugins=[self.plugin],
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
        finally:
            quiet.setLevel(level)
        assert self.trainer.strategy.checkpoint_io is self.plugin
        self.newest: Path | None = None

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.root / f"checkpoint-{checkpoint:04d}.ckpt"
        before = self.disk_bytes()
        start = time.perf_counter()
        self.trainer.strategy.save_checkpoint(state, path)
        stall = time.perf_counter() - start
        self.plugin.wait()
        elapsed = time.perf_counter() - start
        self.newest = path
        return SaveStats(stall, elapsed, self.disk_bytes() - before)

    def restore(self) -> Any:
        from lightning_incremental.core.format.canonical import forget_parsed

        assert self.newest is not None
        forget_parsed()  # as a resuming process
        plugin = self._plugin()
        try:
            return plugin.load_checkpoint(self.newest)
        finally:
            plugin.teardown()

    def close(self) -> None:
        self.plugin.teardown()


# DCP warns on every single-process save/load; that is the documented way to use it here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


class _Dcp(System):
    """``torch.distributed.checkpoint`` in one process (no process group: DCP's documented
    single-process mode), one directory per checkpoint through a ``FileSystemWriter``
    (``sync_files=True``: every file fsynced); the directories are fsynced after it, as
    torch_save's. Restore: ``dcp.load`` in place into a state allocated from the saved layout, as
    a resuming process loads into its model's and optimizer's own state dicts."""

    fsync = True

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.newest: Path | None = None
        self.layout: Any = None

    def path(self, checkpoint: int) -> Path:
        return self.root / f"checkpoint-{checkpoint:04d}"

    def _durable(self, path: Path, state: dict[str, Any]) -> int:
        _fsync_dir(path)
        _fsync_dir(self.root)
        # the layout only: every tensor on the meta device
        self.newest, self.layout = path, map_tensors(state, lambda t: t.to("meta"))
        return _dir_bytes(path)

    def restore(self) -> Any:
        assert self.newest is not None
        # empty CPU tensors: pages untouched until written, as torch.load's own allocations
        state = map_tensors(self.layout, lambda t: torch.empty_like(t, device="cpu"))
        self.dcp.load(state, storage_reader=self.dcp.FileSystemReader(self.newest), no_dist=True)
        return state


@system
class DcpSave(_Dcp):
    name = "dcp_save"
    summary = "torch.distributed.checkpoint.save, FileSystemWriter (fsync); blocks"

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.path(checkpoint)
        start = time.perf_counter()
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(path), no_dist=True)
        written = self._durable(path, state)
        elapsed = time.perf_counter() - start
        return SaveStats(elapsed, elapsed, written)


@system
class DcpAsyncSave(_Dcp):
    """``dcp.async_save``: stages a CPU copy of every tensor on the caller's thread, then plans
    and writes in a background thread; ``save_s`` ends when its future completes (and the
    directories are fsynced)."""

    name = "dcp_async"
    summary = "torch.distributed.checkpoint.async_save (thread), FileSystemWriter (fsync)"

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.path(checkpoint)
        start = time.perf_counter()
        future = self.dcp.async_save(
            state, storage_writer=self.dcp.FileSystemWriter(path), no_dist=True
        )
        stall = time.perf_counter() - start
        assert isinstance(future, Future), type(future)
        future.result()
        written = self._durable(path, state)
        return SaveStats(stall, time.perf_counter() - start, written)


class _Extras:
    """The entries of the Lightning-shaped state that are neither the model nor the optimizer
    (epoch, step, RNG), registered with ``Accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


@dataclass
class _Prepared:
    accelerator: Any
    work: Workload
    extras: _Extras

    @classmethod
    def of(cls, work: Workload) -> _Prepared:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        accelerator.prepare(work.model, work.optimizer)  # the same objects, wrapped
        extras = _Extras()
        accelerator.register_for_checkpointing(extras)
        return cls(accelerator, work, extras)


@system
class AccelerateSaveState(System):
    """Accelerate's ``save_state``: ``Accelerator(cpu=True)`` with the live model and optimizer
    prepared and the rest of the state registered; writes ``model.safetensors``,
    ``optimizer.bin``, RNG and custom-object pickles (blocking; Accelerate does not fsync).
    Restore: ``load_state`` into a freshly built model and optimizer in a second Accelerator."""

    name = "accelerate"
    summary = "Accelerate save_state / load_state (cpu=True, model + optimizer prepared); blocks"
    fsync = False
    _MODEL_KEYS = ("state_dict", "optimizer_states")

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        self.newest: Path | None = None
        self.keys: list[str] = []

    def attach(self, work: Workload, rebuild: Callable[[], Workload]) -> None:
        self.live = _Prepared.of(work)
        self.target = _Prepared.of(rebuild())

    def save(self, state: dict[str, Any], checkpoint: int, step: int) -> SaveStats:
        path = self.root / f"checkpoint-{checkpoint:04d}"
        self.live.extras.value = {k: v for k, v in state.items() if k not in self._MODEL_KEYS}
        self.keys = list(state)
        start = time.perf_counter()
        self.live.accelerator.save_state(str(path))
        elapsed = time.perf_counter() - start
        self.newest = path
        return SaveStats(elapsed, elapsed, _dir_bytes(path))

    def restore(self) -> Any:
        assert self.newest is not None
        self.target.accelerator.load_state(str(self.newest))
        parts = {
            **self.target.extras.value,
            "state_dict": self.target.work.model.state_dict(),
            "optimizer_states": [self.target.work.optimizer.state_dict()],
        }
        return {key: parts[key] for key in self.keys}


def _mbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e6 if seconds > 0 else None
