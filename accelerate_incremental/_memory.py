"""The memory tier under :class:`~accelerate_incremental.IncrementalCheckpointer`: every
``memory_every_n_steps`` steps of :meth:`~accelerate_incremental.IncrementalCheckpointer.maybe_save`
each process puts its part of the checkpoint — what a persistent save of that step would hold,
with its own random state and DataLoader positions — into node-local memory and, in the
background, onto ``memory_replicas`` other nodes; :meth:`load` resumes from the newest step every
process agrees on when it is at least the store's newest, else from the store (the
framework-free part: :mod:`lightning_incremental.runtime.memory.steps`).

A step whose batch ends an epoch of a tracked DataLoader is not taken (its epoch's end work
comes after it; the previous memory step stays). FSDP keeps the persistent store only.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from accelerate_incremental import _state
from lightning_incremental.runtime.cluster.coordinate import coordinated
from lightning_incremental.runtime.memory import steps as memory_steps
from lightning_incremental.runtime.memory.steps import MemoryOptions

log = logging.getLogger("accelerate_incremental")

OWNER = "IncrementalCheckpointer"


def options(every: Any = None, replicas: Any = 1, directory: Any = None) -> MemoryOptions:
    """The checked ``memory_every_n_steps``, ``memory_replicas`` and ``memory_dir``.

    Raises:
        ConfigError: a bad interval or number of replicas.
        TypeError: ``memory_dir`` is not a path.
    """
    path = (
        directory if directory is None or not isinstance(directory, os.PathLike) else str(directory)
    )
    return MemoryOptions(every, replicas, path, every_name="memory_every_n_steps")


class AccelerateMemory(memory_steps.MemorySteps):
    """One checkpointer's memory tier. Create on every process at once."""

    def __init__(
        self, opts: MemoryOptions, accelerator: Any, url: str, generation: int | None, **kw: Any
    ) -> None:
        self.accelerator = acc = accelerator
        self.unsaved: int | None = None  # a resumed step the store lacked (resume_state)
        main = acc.is_main_process
        super().__init__(
            opts,
            rank=acc.process_index,
            world_size=acc.num_processes,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            url=url,
            generation=generation,
            owner=OWNER,
            info=lambda text: log.info(text) if main else None,
            warn=lambda text: warnings.warn(text, UserWarning, stacklevel=3) if main else None,
            replicated=True,  # FSDP keeps the store only (see start)
            local_rank=acc.local_process_index,
            **kw,
        )

    def maybe_take(self, step: int, loaders: Any) -> None:
        """Take ``step`` into memory when it is due and no tracked DataLoader's epoch ends here."""
        if not self.due(step) or loaders.at_epoch_end():
            return
        acc = self.accelerator
        local = _state.process_state(acc, loaders)  # its buffers too, if DDP keeps them apart
        if not self.whole:  # the node's first process takes the replicated state (see steps)
            self.take(step, {"step": step, "processes": [local]})
            return
        models, optimizers = _state.full(acc)
        iteration = acc.project_configuration.iteration
        state = _state.checkpoint(acc, models, optimizers, iteration, [local])
        self.take(step, {"step": step, "state": state})

    def resume_state(self, newest_persistent: int | None) -> tuple[int, dict[str, Any], str] | None:
        """Every process together: ``(step, state, tier)`` from the memory tier, the state as
        the store's would be (every process's part: this process's own), or None for the
        store. Logs the resume line."""
        found = self.resume(newest_persistent, _check_step, _merge)
        if found is None:
            return None
        step, part, tier = found
        self.last_step = step  # what this process's memory stands for, until its next step
        # nothing but the nodes' memory holds it: saved to the store at close, unless a step
        # comes first (IncrementalCheckpointer._load)
        self.unsaved = step if newest_persistent is None or newest_persistent < step else None
        state = part["state"]
        state["processes"] = state["processes"] * self.world  # this process's own, at its index
        if self.accelerator.is_main_process:
            log.info(
                f"{OWNER}: resuming from step {step} of the memory tier "
                f"({memory_steps.how(tier)}); tier={tier}"
            )
        return step, state, tier


def _merge(whole: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """This process's part: its node's first process's, with this process's own state (its
    random state, DataLoader positions and, if DDP keeps them apart, buffers: restored with it)."""
    whole["state"]["processes"] = own["processes"]
    return whole


def _check_step(part: Any, step: int) -> None:
    held = part.get("step") if isinstance(part, dict) else None
    if held != step or "state" not in part:
        raise ValueError(f"the part holds step {held!r}, not {step}")


def start(
    accelerator: Any, store: Any, generation: int | None, sharded: bool, memory: tuple[Any, ...]
) -> AccelerateMemory | None:
    """The checkpointer's memory tier (``memory``: ``memory_every_n_steps``,
    ``memory_replicas``, ``memory_dir``), or None when it is off (or FSDP shards the state)."""
    opts = options(*memory)
    if not opts.enabled:
        return None
    if sharded:
        if accelerator.is_main_process:
            warnings.warn(
                f"{OWNER}: the memory tier does not support FSDP yet; this run checkpoints to "
                "the persistent store only",
                UserWarning,
                stacklevel=3,
            )
        return None
    allow_pickle = store.config.allow_pickle
    return AccelerateMemory(
        opts, accelerator, str(store.url), generation, allow_pickle=allow_pickle
    )


def load(memory: AccelerateMemory, store: Any) -> tuple[int, dict[str, Any], str] | None:
    """Every process together: the memory tier's agreed ``(step, state, tier)``, not older
    than the store's newest committed step (the main process lists it), or None for the store."""
    acc = memory.accelerator
    newest = coordinated(
        lambda: max(store.steps(), default=None),
        what=f"list the checkpoints in {store.url}",
        is_coordinator=acc.is_main_process,
    )
    return memory.resume_state(newest)


def lacked(memory: AccelerateMemory | None, step: int) -> bool:
    """``step`` came from the memory tier and the store lacked it."""
    return memory is not None and memory.unsaved == step


def log_store(memory: AccelerateMemory | None, step: int, url: Any) -> None:
    """The resume line when the memory tier is on and the store gave the step."""
    if memory is not None and memory.accelerator.is_main_process:
        log.info(f"{OWNER}: resuming from step {step} of {url}; tier=store")


def close(memory: AccelerateMemory | None, store: Any, *, finished: bool) -> None:
    """Stop this process's memory tier. Finished, with the store holding a step at least as new
    as the last memory step (this process lists the store once): delete this process's parts
    and the replicas it keeps, freeing the node's memory; else they stay for a resume."""
    if memory is not None:
        memory.end((lambda: max(store.steps(), default=None)) if finished else None)
