"""What :class:`~.callback.IncrementalCheckpoint` holds for one ``fit`` (:class:`FitState`),
and the two small pieces it puts beside the Trainer: :class:`TrainerLoop` (what the save-point
decisions ask the training loop) and :class:`BetweenEpochs` (the callback that runs first, for the
save due at an epoch's end); :func:`open_fit_store` opens the store at a fit's setup."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit import fencing
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import data_position as dp
from lightning_incremental.lightning import resize, resume
from lightning_incremental.lightning.fit_checks import replicated_state
from lightning_incremental.lightning.memory import MemorySteps
from lightning_incremental.lightning.preemption import PreemptionPoint
from lightning_incremental.lightning.resume import ResumeHook
from lightning_incremental.lightning.save_points import BatchCounts, Declined, SaveNow, SavePoints
from lightning_incremental.lightning.saver import Saver
from lightning_incremental.runtime.cluster import writing
from lightning_incremental.runtime.cluster.coordinate import coordinated
from lightning_incremental.runtime.cluster.watchdog import Watchdog
from lightning_incremental.runtime.policy import replica_policy

log = logging.getLogger("lightning_incremental.lightning.callback")

_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


@dataclass
class FitState:
    """What :class:`~.callback.IncrementalCheckpoint` holds for one ``fit``: a new one at every
    setup (everything it resets there)."""

    preemption: PreemptionPoint
    points: SavePoints
    url: str | None = None
    saver: Saver | None = None
    resume_hook: ResumeHook | None = None
    disabled: bool = False  # fast_dev_run
    newest: int | None = None  # the store's newest step when the fit started
    resumed_step: int | None = None
    resumed_tier: str | None = None  # "memory", "peer" or "store"
    payload: dict[str, Any] | None = None  # per-rank state of the restored checkpoint
    restored: bool = False
    finish_restart: bool = False  # resumed mid-epoch: leave Lightning's restart mode
    front: BetweenEpochs | None = None
    epoch_record: dict[str, Any] | None = None
    iter_at_epoch_start: object | None = None
    check_iter: bool = False
    skip_epoch_record: bool = False
    warnings_guard: warnings.catch_warnings[Any] | None = None
    generation: int | None = None
    watchdog: Watchdog | None = None
    sharded: bool = False  # the strategy shards the state (see _sharded.layout)
    remap: resize.Remap | None = None  # the resumed epoch's rest, cut for another world size
    memory: MemorySteps | None = None  # the memory tier, when on

    def saved_before(self, last: int | None) -> int | None:
        """The callback's ``last_saved_step`` as the checkpoint this fit resumed from recorded
        it, for this fit. A memory step records the store's save of its own batch as made, but
        that save commits in the background and may have died with the process: after a resume
        from memory only a step the store held when this fit started counts as saved (else a
        preemption or the end of training would skip a step the store lacks, and say it is
        committed)."""
        if self.resumed_tier not in ("memory", "peer") or last is None:
            return last
        return last if self.newest is not None and last <= self.newest else self.newest

    def newest_committed(self) -> int | None:
        """The store's newest step as this process knows it: its saver's last commit in this
        fit, else the store's newest when the fit started."""
        last = self.saver.last_committed if self.saver is not None else None
        return last if last is not None else self.newest

    def loop_skipped_after_memory(self) -> bool:
        """Whether this fit resumed from a memory step at which training was already done (its
        last step, newer than the store): Lightning then skips the training loop, and with it
        ``on_train_end``, whose final save and freeing of the memory must still happen."""
        return (
            not self.disabled
            and self.resumed_tier in ("memory", "peer")
            and not self.points.started
        )

    def resumed(self, step: int, tier: str = "store") -> None:
        """The fit resumed from ``step`` of ``tier`` (told by ResumeHook)."""
        self.resumed_step, self.resumed_tier = step, tier

    def epoch_started(self, trainer: pl.Trainer) -> None:
        """A training epoch starts: record how it begins (to recreate it on a mid-epoch resume)."""
        self.points.epoch_started()
        if self.remap is not None and self.remap.epoch != trainer.current_epoch:
            self.undo_remap()  # the remapped epoch is over: the loader's own sampler again
        if self.skip_epoch_record:  # this epoch's iterator was just recreated from a record
            self.skip_epoch_record = False
            return
        self.epoch_record = dp.record_epoch_start(trainer, iter_created=False)
        self.iter_at_epoch_start = dp.epoch_iterator(trainer)
        self.check_iter = True

    def batch_started(self, trainer: pl.Trainer) -> None:
        self.close_warnings_guard()
        if self.finish_restart:
            self.finish_restart = False
            _compat.finish_restart(trainer)
        if self.check_iter:  # did Lightning create this epoch's iterator before or after us?
            self.check_iter = False
            if self.epoch_record is not None:
                created = dp.epoch_iterator(trainer) is self.iter_at_epoch_start
                self.epoch_record["iter_created"] = created
            self.iter_at_epoch_start = None
        self.points.batch_started(trainer.global_step)

    def restore_position(self, trainer: pl.Trainer) -> None:
        """Put this rank's random state and data position back from the restored checkpoint."""
        restored = resume.restore_rank_state(trainer, self.payload)
        self.payload = None
        if restored is None:
            return
        self.epoch_record = restored.epoch_record
        self.remap = restored.remap
        # Lightning starts the resumed epoch with on_train_epoch_start: a remapped epoch keeps
        # the record of its cut (see resize) for the next checkpoints
        remapped = restored.remap is not None
        self.skip_epoch_record = (restored.recreated and not restored.mid_epoch) or remapped
        self.points.epoch_open = restored.mid_epoch
        self.finish_restart = restored.mid_epoch
        if restored.mid_epoch and restored.epoch_record is not None:
            # Lightning warns that a plain dataloader restarts its epoch: here it does not.
            self.warnings_guard = warnings.catch_warnings()
            self.warnings_guard.__enter__()
            warnings.filterwarnings(
                "ignore", message=_LIGHTNING_NOT_RESUMABLE, category=PossibleUserWarning
            )

    def check_replicas(self, trainer: pl.Trainer, replica_check: str) -> replica_policy.Verdict:
        """Compare the replicas' weights and optimizer state (every rank at once); see
        :func:`~lightning_incremental.runtime.policy.replica_policy.check_before_save`."""
        if trainer.world_size == 1 or self.sharded:  # shards differ by design
            return replica_policy.Verdict(None)
        saver = self.saver
        assert saver is not None
        return replica_policy.check_before_save(
            lambda: replicated_state(trainer),
            replica_check,
            finish_saves=lambda: saver.collect(block=True),
            barrier=trainer.strategy.barrier,
        )

    def exception_decision(self, trainer: pl.Trainer, last_saved: int | None) -> SaveNow | None:
        """The save-point decision at an exception (see :meth:`SavePoints.at_exception`), with
        the reason told when it declines."""
        if self.disabled:
            return None
        total: Any = _compat.batch_progress_total(trainer)
        decision = self.points.at_exception(
            trainer.global_step,
            last_saved,
            fitting=trainer.state.fn == TrainerFn.FITTING,
            world_size=trainer.world_size,
            validating=bool(trainer.sanity_checking or trainer.validating),
            batches=BatchCounts(total.ready, total.started, total.processed, total.completed),
        )
        if isinstance(decision, Declined):
            newest = self.saver.last_committed if self.saver is not None else None
            last = "none yet" if newest is None else f"newest committed checkpoint: step {newest}"
            rank_zero_warn(
                f"IncrementalCheckpoint: not saving on exception: {decision.why} ({last})."
            )
            return None
        return decision

    def at_exception(
        self,
        trainer: pl.Trainer,
        exception: BaseException,
        last_saved: int | None,
        save: Callable[[pl.Trainer, SaveNow], None],
    ) -> None:
        """``on_exception``: save if the state is consistent (``save``), wait for the saves in
        flight, exit for a preemption; then shut this fit down. An error of ours is logged: the
        training error propagates."""
        try:
            preempted = self.preemption.handles(exception)
            decision = None if preempted else self.exception_decision(trainer, last_saved)
            if decision is not None:
                save(trainer, decision)
            if self.saver is not None:
                self.saver.collect(block=True)
                self.saver.log_failures()
            if preempted:
                self.preemption.exit_with_code(exception)
        except Exception:
            log.exception("IncrementalCheckpoint: saving after %r failed", exception)
        finally:
            self.shutdown(raise_errors=False, finished=False)

    def reader(
        self, open_store: Callable[[], CheckpointStore]
    ) -> Callable[[], AbstractContextManager[CheckpointStore]]:
        """For ResumeHook: the writing store where this rank has one (rank 0; every rank of a
        sharded run): a resumed run's first save then builds on what it loaded. Elsewhere a
        store from ``open_store``, closed after reading."""

        @contextlib.contextmanager
        def store_for_reading() -> Iterator[CheckpointStore]:
            store = self.saver.store if self.saver is not None else None
            if store is not None:
                yield store
                return
            store = open_store()
            try:
                yield store
            finally:
                store.close()

        return store_for_reading

    def shutdown(self, *, raise_errors: bool, finished: bool = True) -> None:
        """End this ``fit``'s machinery. ``finished``: training ended normally; otherwise the
        watchdog stops without telling the others this rank is done (if they wait for it, they
        must find it dead and restart rather than wait out a collective timeout)."""
        dog, self.watchdog = self.watchdog, None
        if dog is not None:
            dog.stop(finished=finished)
        self.preemption.stop()
        self.close_warnings_guard()
        self.undo_remap()
        hook, self.resume_hook = self.resume_hook, None
        if hook is not None:
            hook.remove()
        memory, self.memory = self.memory, None
        if memory is not None:  # a failed fit does not wait long for a peer that may be gone
            memory.close(60.0 if finished else 5.0)
        if self.saver is not None:
            self.saver.close(raise_errors=raise_errors)

    def undo_remap(self) -> None:
        remap, self.remap = self.remap, None
        if remap is not None:
            remap.undo()

    def close_warnings_guard(self) -> None:
        guard, self.warnings_guard = self.warnings_guard, None
        if guard is not None:
            guard.__exit__(None, None, None)


class TrainerLoop:
    """:class:`~.save_points.Loop` over a Trainer (and this fit's saver)."""

    def __init__(self, trainer: pl.Trainer, saver: Saver | None = None) -> None:
        self.trainer = trainer
        self.saver = saver

    def time_due(self, due_here: bool) -> bool:
        return self.agree(due_here)  # rank 0's clock decides

    def agree(self, due_here: bool) -> bool:
        agreed: bool = self.trainer.strategy.broadcast(due_here, src=0)
        return agreed

    def save_in_flight(self) -> bool:
        return self.saver is not None and self.saver.in_flight()

    def max_steps_reached(self) -> bool:
        return _compat.max_steps_reached(self.trainer)

    def epoch_ends_here(self) -> bool:
        return _compat.epoch_ends_here(self.trainer)

    def validation_follows(self) -> bool:
        return _compat.validation_follows(self.trainer)


class BetweenEpochs(Callback):
    """Runs first among the trainer's callbacks, to take the checkpoint due at an epoch's end
    once Lightning finished that epoch and before anything begins the next one (it holds no
    state; ``IncrementalCheckpoint`` adds it to the trainer in ``setup``). ``at_epoch_start``:
    the owner's handler."""

    def __init__(self, owner: Callback, at_epoch_start: Callable[[pl.Trainer], None]) -> None:
        self.owner = owner
        self._at_epoch_start = at_epoch_start

    @property
    @override
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[{self.owner.state_key}]"

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_epoch_start(trainer)


def open_fit_store(
    trainer: pl.Trainer,
    fit: FitState,
    open_store: Callable[..., CheckpointStore],
    *,
    claim_unless_refused: bool,
) -> CheckpointStore | None:
    """Open the store at a ``fit``'s setup and note its newest step and the fencing generation
    claimed in ``fit``; returns this rank's writing store (None on the ranks that do not save).

    Rank 0 opens the store and starts writing it (:mod:`~lightning_incremental.runtime.
    writing`: the writer lease, a probe, the fencing generation of a new incarnation of the
    job), before anything is resumed or trained; whatever happens there, every rank learns it,
    so a failure never leaves the other ranks waiting in a collective. Sharded over several
    ranks, every rank then opens the store it saves its own shards through (a collective), and
    rank 0 takes the lease again through it. ``open_store(distributed=)`` opens the store;
    ``claim_unless_refused``: start writing even a store that holds checkpoints (resume=True; a
    run about to refuse the store, resume=False on a store in use, does not take it).
    """
    distributed = fit.sharded and trainer.world_size > 1
    store: CheckpointStore | None = None

    def open_on_coordinator() -> tuple[int | None, int | None]:
        nonlocal store
        store = open_store()
        try:
            steps = store.steps()
            newest = steps[-1] if steps else None
            generation = None
            if claim_unless_refused or newest is None:  # the claim keeps what is visible
                generation = writing.begin(store, claim=fencing.should_claim(trainer.world_size))
        except BaseException:
            store.close()
            raise
        if distributed:
            store.close()
            store = None
        return newest, generation

    fit.newest, fit.generation = coordinated(
        open_on_coordinator,
        what=f"open the checkpoint store {fit.url}",
        is_coordinator=trainer.is_global_zero,
        broadcast=trainer.strategy.broadcast,
    )
    if distributed:
        store = open_store(distributed=True)
        if claim_unless_refused or fit.newest is None:
            try:
                writing.begin_everywhere(
                    store,
                    claim=False,
                    is_coordinator=trainer.is_global_zero,
                    broadcast=trainer.strategy.broadcast,
                )
            except BaseException:
                store.close()
                raise
    return store


class Copies:
    """Deep copies and pickles (``copy.deepcopy(trainer.callbacks)``, ``torch.save(trainer)``)
    of :class:`~.callback.IncrementalCheckpoint`: they keep its configuration and restored state
    (``state_dict``) and drop the per-``fit`` machinery (store, background saves, watchdog,
    signal handling), which cannot be copied: a copy holds a fresh :class:`FitState`, as before
    its first ``fit``."""

    def _reset_run_state(self) -> None:  # the callback's: a new FitState
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["_fit"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._reset_run_state()
