"""The callback's preemption path (the mechanism:
:mod:`lightning_incremental.runtime.policy.preemption`).

At a training batch's end (or a validation run's: :meth:`PreemptionPoint.hold_during_validation`)
when any rank was asked to stop — a preemption signal (ours, or
Lightning's own SIGTERM handler), or :meth:`~.callback.IncrementalCheckpoint.request_preemption`
— every rank saves that step, waits for its commit and makes Lightning stop right there; the
``SIGTERMException`` Lightning then raises on every rank exits with the configured code (143)
instead of 0. Under DDP one small all-reduce per batch is how the ranks agree: a signal reaches
them at different times, a cloud notice perhaps one node only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning.pytorch as pl

from lightning_incremental.lightning import compat as _compat
from lightning_incremental.runtime.policy.preemption import Preemption, PreemptionConfig

log = logging.getLogger(__name__)


class PreemptionPoint:
    """One ``fit``'s preemption state: the request, the step it stopped at, the exit code."""

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self.state = Preemption(config)
        self.step: int | None = None  # the step saved for the notice
        self.trainer: pl.Trainer | None = None

    def start(self, trainer: pl.Trainer) -> None:
        """Handle the signals; called at ``on_train_start``, after Lightning installed its own
        (ours runs first, then theirs without its collective, checkpoint or logging:
        :func:`~.compat.signal_handler_without_collectives`; ours is taken off first at
        teardown). A SIGTERM that Lightning's handler saw before is a request, and its flag is
        held until the ranks agree."""
        if not self.config.enabled:
            return
        self.trainer = trainer
        self.state.install(
            lambda signum, handler: _compat.signal_handler_without_collectives(trainer, handler)
        )
        if _compat.received_sigterm(trainer):
            self.state.request("SIGTERM")
            _compat.hold_sigterm(trainer)

    def stop(self) -> None:
        """The fit ends. After a preemption the process is on its way out with code 143: the
        handled signals stay ignored through Lightning's teardown (which would put back the
        handlers it found) until the process exits; otherwise the handlers are put back."""
        if self.step is None:
            self.state.uninstall()
            return
        signums = self.state.stay_until_exit()
        if self.trainer is not None:
            _compat.ignore_signals_after_fit(self.trainer, signums)

    def request(self, reason: str) -> None:
        self.state.request(reason)

    def observe_save(self, seconds: float) -> None:
        self.state.observe_save(seconds)

    def at_batch_end(
        self, trainer: pl.Trainer, save_and_wait: Callable[[pl.Trainer], None]
    ) -> bool:
        """Whether training stops here for a preemption (then this step is committed)."""
        if not self.config.enabled or self.step is not None:
            return False
        if _compat.received_sigterm(trainer):
            self.state.request("SIGTERM")
            _compat.hold_sigterm(trainer)
        if trainer.world_size > 1:
            strategy = trainer.strategy
            agreed = self.state.agree(
                lambda flag: bool(strategy.reduce_boolean_decision(flag, all=False))
            )
        else:
            agreed = self.state.agree()
        if not agreed:
            return False
        save_and_wait(trainer)
        self.step = trainer.global_step
        # Lightning's SLURM requeue handler would have requeued at the signal (before any
        # commit): the job is requeued now that this step committed.
        self.state.requeue(
            rank=trainer.global_rank, requeue_default=_compat.slurm_auto_requeue(trainer)
        )
        _compat.stop_as_on_sigterm(trainer)  # every rank raises SIGTERMException right here
        return True

    def hold_during_validation(self, trainer: pl.Trainer) -> None:
        """A SIGTERM during a validation run of ``fit``: let the validation finish (its random
        draws are part of the run) and stop at its end, where the state is the one an
        uninterrupted run has: Lightning would stop at the next validation batch."""
        if self.config.enabled and self.step is None and _compat.received_sigterm(trainer):
            self.state.request("SIGTERM")
            _compat.hold_sigterm(trainer)

    def handles(self, exception: BaseException) -> bool:
        """Whether ``exception`` is the stop this path asked for."""
        return self.step is not None and _compat.is_sigterm(exception)

    def exit_with_code(self, exception: BaseException) -> None:
        """Lightning's ``SIGTERMException`` exits with code 0, which a scheduler reads as a
        finished job: the preempted process exits with the configured code instead."""
        if isinstance(exception, SystemExit):
            exception.code = self.config.exit_code
        request = self.state.request_
        log.warning(
            "IncrementalCheckpoint: preempted at step %s (%s); the checkpoint of that step is "
            "committed, exiting with code %d",
            self.step,
            request.reason if request is not None else "preemption",
            self.config.exit_code,
        )
