"""The resume side of :class:`~accelerate_incremental.trainer.checkpointer.TrainerCheckpointer`: the
Trainer's load points (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``, ``_load_best_model``), each restoring from the store when
the folder is a marker, from the memory tier when it is the folder of a memory resume
(:mod:`~._trainer_memory`), and running the Trainer's own code for a folder it wrote itself."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from accelerate_incremental import _compat
from accelerate_incremental.trainer import markers
from accelerate_incremental.trainer import memory as memory_tier
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.state import rng

ABSENT = (
    "its save never committed (the run stopped first), or the step was deleted since "
    "(retention, a gc, or a later run resumed from an older checkpoint)"
)


def announce(trainer: Any, message: str) -> None:
    """Log ``message`` once per job (on the main process), where a default logging set-up shows
    it."""
    if trainer.is_world_process_zero():
        memory_tier.log.warning("accelerate_incremental: %s", message)


class TrainerLoading:
    """The load hooks; mixed into the checkpointer, whose ``trainer``, ``store``, ``url``,
    ``memory``, ``_processes``, ``resumed_from``, ``resumed_tier`` and ``_settle`` they use."""

    trainer: Any
    store: Any
    url: str
    memory: memory_tier.TrainerMemory | None
    _processes: list[Any] | None
    resumed_from: int | None
    resumed_tier: str | None
    _settle: Callable[..., None]

    def marker(self, folder: Any) -> markers.Marker | None:
        """The marker of ``folder`` (None: a folder the Trainer wrote itself).

        Raises:
            ValueError: the marker names another store, or a step that never committed.
        """
        found = markers.read(folder) if isinstance(folder, (str, os.PathLike)) else None
        if found is None:
            return None
        if found.store != self.url:
            raise ValueError(
                f"{folder} is a checkpoint of the store {found.store}, but this Trainer saves to "
                f"{self.url}: run with --dirpath {found.store} to resume from it"
            )
        committed = self.store.steps()
        if found.step not in committed:
            raise ValueError(
                f"{folder} records step {found.step}, which is not in {self.url}: {ABSENT}; "
                f"committed steps: {committed}. Resume from one of those folders, or with "
                "resume_from_checkpoint=True (the newest committed)"
            )
        return found

    def _load_from_checkpoint(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _load_from_checkpoint(path: Any, model: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self._from_memory(path) is None and self.marker(path) is None:
                return own(path, model, *args, **kwargs)
            return None  # restored after accelerator.prepare, with the optimizer

        return _load_from_checkpoint

    def _load_optimizer_and_scheduler(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _load_optimizer_and_scheduler(path: Any, *args: Any, **kwargs: Any) -> Any:
            memory = self._from_memory(path)
            if memory is not None:
                memory_tier.apply_state(self.trainer, memory.state)
                self.resumed_from, self.resumed_tier = memory.step, memory.tier
                self._warn_buffers()
                return None
            found = self.marker(path)
            if found is None:
                return own(path, *args, **kwargs)
            self.restore(found.step)
            return None

        return _load_optimizer_and_scheduler

    def restore(self, step: int) -> None:
        """Restore the weights, optimizer, scheduler and scaler of checkpoint ``step`` (this
        process reads them itself); keep its random states for :meth:`_load_rng_state`."""
        trainer = self.trainer
        state = self.store.load(step, map_location="cpu")
        if state.get("format") != memory_tier.FORMAT:
            raise ValueError(
                f"step {step} of {self.url} is not a Trainer checkpoint (format "
                f"{state.get('format')!r}); was the store written by another integration?"
            )
        memory_tier.apply_state(trainer, state)
        self._processes = state["processes"]
        self.resumed_from, self.resumed_tier = step, "store"
        announce(trainer, f"restored step {step} from {self.url} (verified)")
        self._warn_buffers()

    def _from_memory(self, path: Any) -> memory_tier.Resumed | None:
        return self.memory.resumed_at(path) if self.memory is not None else None

    def _warn_buffers(self) -> None:
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        if _compat.buffers_kept_apart(trainer.accelerator) and any(True for _ in model.buffers()):
            announce(  # the Trainer's checkpoints keep the main process's buffers only
                trainer,
                "this resume is not exact: ddp_broadcast_buffers=False keeps each process's "
                "buffers apart, but the checkpoint holds the main process's, which every "
                "process resumes with",
            )

    def _load_scaler(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _load_scaler(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self._from_memory(path) is None and self.marker(path) is None:
                return own(path, *args, **kwargs)
            return None  # restored with the optimizer

        return _load_scaler

    def _load_rng_state(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _load_rng_state(path: Any, *args: Any, **kwargs: Any) -> Any:
            memory = self._from_memory(path)
            if memory is not None:  # this process's own, at every index
                rng.restore(memory.state["processes"][0])
                return None
            found = self.marker(path)
            if found is None:
                return own(path, *args, **kwargs)
            processes = self._processes
            if processes is None:
                processes = self.store.load(found.step, keys="processes")["processes"]
            world = self.trainer.args.world_size
            if len(processes) != world:
                warnings.warn(
                    f"{path} was saved by {len(processes)} processes, this run has {world}: "
                    "the random states are not restored, so the resume is not bit-exact",
                    UserWarning,
                    stacklevel=2,
                )
                return None
            rng.restore(processes[self.trainer.args.process_index])
            return None

        return _load_rng_state

    def _load_best_model(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _load_best_model(*args: Any, **kwargs: Any) -> Any:
            trainer = self.trainer
            self._settle(block=True)  # the best checkpoint's save must have committed
            if trainer.is_world_process_zero():
                self.store.wait()
            collectives.barrier()
            found = self.marker(trainer.state.best_model_checkpoint)
            if found is None:
                return own(*args, **kwargs)
            state = self.store.load(found.step, map_location="cpu", keys="model")
            trainer.accelerator.unwrap_model(trainer.model).load_state_dict(state["model"])
            announce(trainer, f"loaded the best model (step {found.step}) from {self.url}")
            return None

        return _load_best_model
