"""Resuming: which checkpoint a ``fit`` starts from, and each rank's state within it.

:class:`ResumeHook` — when ``fit`` gets no ``ckpt_path``, restore the newest committed checkpoint.
Why this mechanism. Lightning picks the checkpoint to restore in ``Trainer._fit_impl`` *before*
any callback hook runs, and restores it through ``_CheckpointConnector.resume_start(path)``, which
reads the file with ``strategy.load_checkpoint(path)``. A callback cannot change that path in time
(``trainer.ckpt_path = ...`` would have to happen before ``fit``), and a path into the store would
be read by ``TorchCheckpointIO`` as a plain file. Restoring the state ourselves in a later hook
(``on_fit_start``) would run Lightning's restore steps in a different order than for a file:
callbacks' ``on_fit_start`` would see unrestored state, the model would be loaded after the
strategy wrapped it.

So during ``fit`` this hook takes the place of ``resume_start`` on the trainer's checkpoint
connector (an instance attribute, removed at teardown). Given a path — the user's
``ckpt_path`` — it calls Lightning's own method unchanged. Given none, it loads the newest
committed checkpoint from the store (rank 0 picks the step, every rank loads that step) and hands
it to the connector exactly as ``resume_start`` would have from a file. Everything after that —
``on_load_checkpoint`` hooks, model, datamodule, callbacks, optimizers, schedulers, loops, the
"Restored all states" message, ``trainer.ckpt_path`` — is Lightning's usual path for
``fit(ckpt_path=...)``, in the usual order.

:func:`rank_state` / :func:`restore_rank_state` — what Lightning's checkpoint lacks for an exact
resume: every rank's global random state (torch, CUDA, numpy, Python) and position in its
training data, saved under :data:`KEY` (all ranks' states, gathered to rank 0, in one checkpoint)
and put back on each rank before the resumed run fetches its first batch.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_incremental.core import CheckpointError, CheckpointStore
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import data_position as dp
from lightning_incremental.lightning import resize
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.runtime.cluster.coordinate import coordinated, describe
from lightning_incremental.runtime.state import rank_buffers
from lightning_incremental.runtime.state import rng as _rng

log = logging.getLogger(__name__)

KEY = "lightning_incremental"  # top-level checkpoint key: every rank's random and data state
FORMAT = 1


@dataclass(frozen=True)
class ResumeSource:
    """What :class:`ResumeHook` needs from the callback that installs it."""

    url: str  # the store, for messages
    sharded: bool  # every rank restores its own shards (see :mod:`~.sharded`)
    store_for_reading: Callable[[], AbstractContextManager[CheckpointStore]]
    resumed: Callable[[int, str], None]  # told the step the fit resumes from, and its tier
    # every rank at once: (step, checkpoint, tier) from the memory tier, or None (see ~.memory)
    memory: Callable[[], tuple[int, dict[str, Any], str] | None] | None = None


class ResumeHook:
    """Makes ``trainer``'s checkpoint connector resume from ``source``'s store when ``fit``
    has no ``ckpt_path``; :meth:`remove` undoes it."""

    def __init__(self, source: ResumeSource, trainer: pl.Trainer) -> None:
        self._source = source
        self._trainer = trainer
        self.remove = _compat.replace_resume_start(trainer, self._resume_start)

    def _resume_start(self, checkpoint_path: Any, original: _compat.Original) -> None:
        if checkpoint_path:
            original(checkpoint_path)
            return
        loaded = self._load_newest()
        if loaded is None:
            original(None)
            return
        _, checkpoint, where = loaded
        rank_zero_info(f"Restoring states from the checkpoint path at {where}")
        saved = checkpoint.get(KEY)
        if isinstance(saved, dict) and saved.get("ranks") and saved["ranks"][0].get("boundary"):
            _compat.between_epochs(checkpoint)  # also what earlier versions saved mid-bookkeeping
        trainer = self._trainer
        own_loader_states(checkpoint, trainer.global_rank, trainer.world_size)
        _compat.set_loaded_checkpoint(trainer, checkpoint, where)

    def _load_newest(self) -> tuple[int, dict[str, Any], str] | None:
        """The memory tier's agreed step, else: rank 0 picks the newest readable step; every
        rank loads that step (collective)."""
        trainer, source = self._trainer, self._source
        found = source.memory() if source.memory is not None else None
        if found is not None:
            source.resumed(found[0], found[2])
            return found[0], found[1], f"the memory tier (step {found[0]})"
        strategy = trainer.strategy
        url = source.url
        checkpoint: dict[str, Any] | None = None
        sharded = source.sharded
        into = _sharded.live_state(trainer) if sharded else _live(trainer)  # on every rank

        def newest() -> int | None:
            nonlocal checkpoint
            with source.store_for_reading() as store:
                step, checkpoint = _newest(store, into)
            return step

        step = coordinated(
            newest,
            what=f"read the checkpoints in {url}",
            is_coordinator=trainer.is_global_zero,
            broadcast=strategy.broadcast,
        )
        error: BaseException | None = None
        if step is None:
            rank_zero_info(f"IncrementalCheckpoint: no checkpoint in {url} yet; starting fresh")
            return None
        if not trainer.is_global_zero:
            try:
                with source.store_for_reading() as store:
                    checkpoint = store.load(step, map_location="cpu", into=into, strict_into=False)
            except Exception as exc:  # reported to every rank by the decision below
                error = exc
        if not strategy.reduce_boolean_decision(error is None, all=True):
            if error is not None:
                raise CheckpointError(
                    f"rank {trainer.global_rank} could not read checkpoint step {step} from "
                    f"{url}: {describe(error)}. Under DDP every rank loads the checkpoint: "
                    "dirpath must be reachable from every rank."
                ) from error
            raise CheckpointError(f"another rank could not read checkpoint step {step} from {url}")
        assert checkpoint is not None
        if sharded:  # these strategies restore after setup, and not through Lightning's hooks
            _sharded.apply(trainer, checkpoint)
        source.resumed(step, "store")
        rank_zero_info(
            f"IncrementalCheckpoint: resuming from step {step} (epoch {checkpoint.get('epoch')}) "
            f"of {url}"
        )
        return step, checkpoint, f"{url} (step {step})"


def _live(trainer: pl.Trainer) -> dict[str, Any]:
    """The model's own tensors, for the engine to restore into (no second copy of the weights:
    Lightning's ``load_state_dict`` then copies each tensor onto itself)."""
    return {"state_dict": trainer.lightning_module.state_dict()}


def _newest(
    store: CheckpointStore, into: dict[str, Any] | None = None
) -> tuple[int | None, dict[str, Any] | None]:
    """The newest checkpoint that restores, and its step. The engine falls back past corrupt
    checkpoints loudly, and sets them aside so that the resumed run may save those steps again.
    """
    steps = store.steps()
    if not steps:
        return None, None
    checkpoint = store.load(map_location="cpu", into=into, strict_into=False)
    step = store.loaded_step
    if checkpoint.get("global_step") != step:  # IncrementalCheckpoint saves at global_step
        raise CheckpointError(
            f"the newest intact checkpoint in {store.url} (step {step}) records "
            f"global_step={checkpoint.get('global_step')!r}: the store was not written by "
            "IncrementalCheckpoint"
        )
    return step, checkpoint


def rank_state(
    trainer: pl.Trainer, boundary: bool, epoch_record: dict[str, Any] | None
) -> dict[str, Any]:
    """This rank's random state and data position, as plain data. ``boundary``: saved between
    epochs (the next epoch has not started); else mid-epoch, where ``epoch_record`` (from
    :func:`~.data_position.record_epoch_start`) recreates the epoch."""
    state = {
        "rng": _rng.capture(),
        "generators": dp.generator_states(dp.train_loaders(trainer)),
        "boundary": boundary,
        "batches": 0 if boundary else _compat.batches_ready(trainer),
        "epoch_start": None if boundary else epoch_record,
        "logged": _compat.logged_state(trainer, running=not boundary),
    }
    if trainer.world_size > 1:
        if rank_buffers.kept_apart(trainer.strategy.model):
            state["buffers"] = rank_buffers.own(trainer.lightning_module)
        loaders = _compat.loader_states(trainer)
        if loaders:  # the checkpoint's loops hold rank 0's: each rank's own resume it
            state["loaders"] = loaders
    return state


def own_loader_states(checkpoint: dict[str, Any], rank: int, world_size: int) -> None:
    """Give this rank its own stateful loaders' states (saved with its random state) in place
    of rank 0's, which the checkpoint's loops hold, when the world size is the one saved; in
    place. A resize keeps Lightning's behaviour (rank 0's: see :func:`restore_rank_state`)."""
    saved = checkpoint.get(KEY)
    if not isinstance(saved, dict) or saved.get("world_size") != world_size:
        return
    ranks = saved.get("ranks")
    if isinstance(ranks, list) and len(ranks) == world_size and "loaders" in ranks[rank]:
        _compat.put_loader_states(checkpoint, ranks[rank]["loaders"])


def _own_buffers(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Put this rank's own buffers back (the ``state_dict`` restored rank 0's); say so when DDP
    keeps each rank's apart and the checkpoint has none (written by an earlier version)."""
    module = trainer.lightning_module
    if "buffers" in state:
        rank_buffers.put(module, state["buffers"])
    elif (
        trainer.world_size > 1
        and rank_buffers.kept_apart(trainer.strategy.model)
        and any(True for _ in module.buffers())
    ):
        rank_zero_warn(
            "IncrementalCheckpoint: this resume is not exact: DDP keeps each rank's buffers "
            "apart (broadcast_buffers=False), but the checkpoint holds rank 0's only (it "
            "was written by an earlier version), so every rank resumes with rank 0's."
        )


@dataclass
class Restored:
    """What :func:`restore_rank_state` did: the record of the epoch in progress (to carry on
    into the next checkpoints), and whether it restored a position mid-epoch."""

    epoch_record: dict[str, Any] | None
    recreated: bool  # the epoch iterator was recreated from epoch_record (don't record again)
    mid_epoch: bool
    remap: resize.Remap | None = None  # the epoch's rest, cut for this world (see resize)


def restore_rank_state(trainer: pl.Trainer, saved: dict[str, Any] | None) -> Restored | None:
    """Put this rank's random state and data position back as they were at the checkpoint (call
    before the resumed run fetches its first batch). ``saved`` is the checkpoint's :data:`KEY`
    entry (None: not written by IncrementalCheckpoint). Warns when the resume cannot be exact;
    returns None when nothing could be restored."""
    loop = trainer.fit_loop
    problem = None
    if saved is None:
        problem = "the checkpoint was not written by IncrementalCheckpoint"
    elif saved.get("format") != FORMAT:
        problem = f"its resume state has the unknown format {saved.get('format')!r}"
    if saved is None or problem is not None:
        restart = " and the interrupted epoch restarts from its first batch"
        rank_zero_warn(
            f"IncrementalCheckpoint: this resume is not exact: {problem}, so random states are "
            f"not restored{restart if loop.restarted_mid_epoch else ''}."
        )
        return None
    ranks = saved["ranks"]
    state = ranks[trainer.global_rank % len(ranks)]
    _own_buffers(trainer, state)
    _compat.restore_logged(trainer, state.get("logged"))
    plan = dp.plan(trainer)
    resized = saved.get("world_size") != trainer.world_size
    if plan.mode != dp.LIGHTNING and (
        resized
        or (not state["boundary"] and resize.needs_remap(state["epoch_start"], trainer.world_size))
    ):
        return _restore_resized(trainer, int(saved["world_size"]), state)
    epoch = loop.epoch_progress.current.processed  # type: ignore[attr-defined]
    rng = state["rng"]
    if plan.mode == dp.LIGHTNING:  # stateful loaders: Lightning restored their position
        _rng.restore(rng)
        if resized:
            old = int(saved["world_size"])
            _warn_resized(
                trainer,
                old,
                f"epoch {epoch}",
                "the training dataloaders are stateful and restore their own position; whether "
                f"it fits {trainer.world_size} rank(s) depends on them",
                steps_note=resize.rescale_max_steps(trainer, old),
            )
        return Restored(None, False, False)
    if state["boundary"]:
        # Saved between two epochs: the next one starts as it did uninterrupted — Lightning
        # creates its iterator after the epoch-start hooks, from the restored random states.
        _rng.restore(rng)
        mismatched = dp.set_generator_states(dp.train_loaders(trainer), state["generators"])
        _compat.start_next_epoch(trainer)
        _report(trainer, [dp.generators_changed(mismatched)] if mismatched else [], plan, 0)
        return Restored(None, False, False)
    record, batches = state["epoch_start"], state["batches"]
    if record is None or plan.mode == dp.IMPOSSIBLE:
        _rng.restore(rng)
        why = "; ".join(plan.caveats) or "the start of this epoch was not recorded"
        rank_zero_warn(
            f"IncrementalCheckpoint: this resume is not exact: {why}. The interrupted epoch "
            f"restarts from its first batch instead of batch {batches}."
        )
        return Restored(None, False, True)
    notes = dp.replay(trainer, record, batches, epoch, plan.mode)
    _rng.restore(rng)
    loaders = dp.train_loaders(trainer)
    current, saved_gens = dp.generator_states(loaders), state["generators"]
    diverged = sorted(
        p
        for p in saved_gens
        if p in current and not _rng.same_generator_state(saved_gens[p], current[p])
    )
    if diverged:
        notes.append(
            "the dataloader's random generators did not arrive at their saved state after "
            f"skipping {batches} batches ({', '.join(diverged)}): the order of this epoch's "
            "remaining batches may differ from the uninterrupted run"
        )
        dp.set_generator_states(loaders, saved_gens)
    _report(trainer, notes, plan, batches)
    return Restored(record, True, True)


def _restore_resized(trainer: pl.Trainer, old: int, state: dict[str, Any]) -> Restored:
    """Resume on another number of ranks (or an epoch a resize already cut anew): the rest of the
    interrupted epoch split over this world (see :mod:`~.resize`), the random state of saved rank
    ``rank % old``, and one account of it all (rank 0 warns)."""
    new, epoch = trainer.world_size, trainer.current_epoch
    loaders = dp.train_loaders(trainer)
    steps_note = resize.rescale_max_steps(trainer, old)
    if state["boundary"]:
        _rng.restore(state["rng"])
        dp.set_generator_states(loaders, state["generators"])
        _compat.start_next_epoch(trainer)
        note = f"epoch {epoch} starts whole, split over the {new} rank(s)"
        _warn_resized(trainer, old, f"at the end of epoch {epoch - 1}", note, steps_note=steps_note)
        return Restored(None, False, False)
    record, batches = state["epoch_start"], int(state["batches"])
    described = (record or {}).get("data_order") or {
        resize.UNMAPPED: "the start of the interrupted epoch was not recorded"
    }
    result = resize.remap(trainer, loaders, described, batches)
    _rng.restore(state["rng"])
    where = f"epoch {epoch}, after {batches} batches per rank"
    if isinstance(result, str):
        total = int(trainer.num_training_batches)
        more = total - batches if total > batches else 1
        note = (
            f"the rest of the interrupted epoch is not known ({result}): Lightning trains "
            f"{more} more batch(es) per rank, from the start of each rank's part of a new "
            "order, so some of the epoch's samples are trained twice and others not at all; to "
            f"avoid it resume on {old} rank(s), let Lightning's DistributedSampler (or a "
            "SequentialSampler in one process) order the data, or save at epoch ends only "
            "(every_n_epochs)"
        )
        _warn_resized(trainer, old, where, note, steps_note=steps_note)
        return Restored(None, False, True)
    remapped, described, resumed = result
    batch_size = int(described["batch_size"])
    _warn_resized(trainer, old, where, "", steps_note, resumed=resumed, batch_size=batch_size)
    return Restored(dict(record, data_order=described), True, True, remapped)


def _warn_resized(
    trainer: pl.Trainer,
    old: int,
    where: str,
    note: str,
    steps_note: str | None,
    *,
    resumed: Any = None,
    batch_size: int = 0,
) -> None:
    """Rank 0 warns with the one account of a resume on another number of ranks."""
    rank_zero_warn(
        resize.account(
            old=old,
            new=trainer.world_size,
            where=where,
            resumed=resumed,
            batch_size=batch_size,
            data_note=note,
            steps_note=steps_note,
        )
    )


def _report(trainer: pl.Trainer, notes: list[str], plan: dp.Plan, batches: int) -> None:
    """Warn about what keeps this resume from being exact: ``plan.caveats`` hold for every rank
    (rank 0 says them), ``notes`` are this rank's own (every rank says its own)."""
    if plan.caveats:
        text = "; ".join(plan.caveats)
        rank_zero_warn(f"IncrementalCheckpoint: this resume may not be exact: {text}")
    if notes:
        where = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""
        warnings.warn(
            f"IncrementalCheckpoint: this resume may not be exact{where}: {'; '.join(notes)}",
            UserWarning,
            stacklevel=2,
        )
    if batches:
        how = "re-read" if plan.mode == dp.REREAD else "skipped"
        rank_zero_info(
            f"IncrementalCheckpoint: resumed mid-epoch {trainer.current_epoch}: {how} the "
            f"{batches} batches already trained on, random states restored"
        )
