"""Saving a trainer's checkpoint through the engine, and what becomes of the saves.

:class:`Saver` takes one checkpoint (every rank takes part: each rank's random state and data
position are gathered, the trainer's own checkpoint dump runs everywhere), hands it to the
:class:`~lightning_incremental.core.CheckpointStore` on global rank 0 — which blocks only for the
snapshot — and later collects the results: figures to the trainer's loggers, errors kept until
the next save or the end of training, where every rank warns about them alike, or raises them
once ``max_consecutive_failures`` saves in a row failed
(:mod:`lightning_incremental.runtime.policy.failures`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from lightning_incremental.core import CheckpointError, CheckpointStore, SaveHandle, SaveResult
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.resume import FORMAT, KEY
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.cluster.coordinate import Outcome
from lightning_incremental.runtime.policy.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    Report,
    text_of,
)

log = logging.getLogger(__name__)

METRIC_PREFIX = "incremental_checkpoint/"


class Saver:
    """One ``fit``'s saves: ``store`` is the engine on global rank 0 (None on the other ranks;
    every rank's own in a sharded run over several ranks),
    ``totals`` the running figures kept across runs (updated in place), ``loggers`` where the
    figures of each committed save go. A failed save is warned about on every rank; the
    ``max_consecutive_failures``-th failed save in a row raises on every rank.

    ``sharded``: the strategy shards the model and optimizer state (see
    :mod:`lightning_incremental.lightning.sharded`): the checkpoint holds every rank's sharded state
    dicts in place of the strategy's own. With a store opened with ``distributed=True`` (on
    every rank), every rank saves (its own shards; rank 0 also the rest) and commits with the
    others."""

    def __init__(
        self,
        store: CheckpointStore | None,
        url: str,
        totals: dict[str, Any],
        loggers: list[Logger],
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        *,
        sharded: bool = False,
    ) -> None:
        self.store = store
        self.sharded = sharded
        # a store opened with ``distributed=True`` on every rank: every rank saves its shards
        self.everywhere = store is not None and store.distributed
        self.url = url
        self.totals = totals
        self.loggers = loggers
        self.results: list[tuple[SaveResult, float]] = []  # with the seconds training blocked
        self.last_committed: int | None = None
        self._pending: list[tuple[SaveHandle, float]] = []
        self._policy = FailurePolicy("IncrementalCheckpoint", url, max_consecutive_failures)

    def save(
        self,
        trainer: pl.Trainer,
        *,
        step: int,
        reason: str,
        boundary: bool,
        rank_state: dict[str, Any],
        audit: dict[str, Any] | None = None,
    ) -> None:
        """Save the trainer's checkpoint as ``step``, with every rank's ``rank_state`` (and
        ``audit``: more plain values for the manifest's audit trail). Call on every rank at
        once: it gathers and broadcasts.

        Earlier saves that failed are warned about on every rank (training goes on), and
        this save is made.

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed (on every rank).
            CoordinatorError: on the other ranks, this save could not start on rank 0.
            Exception: the engine's own error for this save on rank 0 (``UnsupportedValueError``
                naming the key that needs pickling, ...).
        """
        started = time.perf_counter()
        self.collect(block=False)  # errors of earlier saves surface here
        states = _gather(trainer, rank_state, self.everywhere)
        checkpoint = self._dump(trainer)
        if boundary:  # taken once Lightning finished the epoch: a state between two epochs
            _compat.between_epochs(checkpoint)
        handle = None

        def start() -> None:
            nonlocal handle
            store = self.store
            assert store is not None
            checkpoint[KEY] = {"format": FORMAT, "world_size": trainer.world_size, "ranks": states}
            metadata = {
                "epoch": trainer.current_epoch,
                "global_step": step,
                "reason": reason,
                "epoch_boundary": boundary,
                **(audit or {}),
            }
            # an earlier save's error, delivered by the engine now, is recorded as such
            handle = self._policy.start(
                lambda: store.save(
                    checkpoint, step, metadata=metadata, world_size=trainer.world_size
                ),
                lambda: self.collect(block=False),
            )

        saves_here = trainer.is_global_zero or self.everywhere
        outcome: Outcome[None] = Outcome.of(start) if saves_here else Outcome()
        # Rank 0 decides, every rank does the same: warn about failed saves, or raise them;
        # then raise this save's error, if it could not start.
        report, message = trainer.strategy.broadcast(
            (self.failure_report(), outcome.message()), src=0
        )
        if report is not None:
            self.raise_failures(report)
        if self.everywhere:  # every rank raises when a rank could not start its part
            started_everywhere = trainer.strategy.reduce_boolean_decision(
                outcome.error is None, all=True
            )
            if outcome.error is None and not started_everywhere:
                raise CheckpointError(
                    f"could not save checkpoint step {step}: another rank could not start its "
                    "part (that rank raises its error)"
                )
        outcome.result(message, what=f"save checkpoint step {step}")
        if handle is not None:
            self._pending.append((handle, time.perf_counter() - started))

    def _dump(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The trainer's checkpoint dump; sharded, with every rank's sharded state dicts (the
        strategy's own may gather to rank 0)."""
        return _sharded.dump_checkpoint(trainer, self.sharded)

    def in_flight(self) -> bool:
        """A save of this process is still running in the background."""
        return any(not handle.done() for handle, _ in self._pending)

    def collect(self, *, block: bool) -> list[SaveResult]:
        """Report the saves that finished (all of them with ``block``); keep their errors."""
        handles = [h for h, _ in self._pending]
        committed = self._policy.collect(handles, block=block)
        blocked_s = {id(h): blocked for h, blocked in self._pending}
        still = {id(h) for h in handles}
        self._pending = [(h, b) for h, b in self._pending if id(h) in still]
        results = []
        for handle in committed:
            result = handle.wait()
            results.append(result)
            self._report(result, blocked_s[id(handle)])
        return results

    def failure_text(self) -> str | None:
        """The failed saves not reported yet: ``"step 6: StorageError: ...; ..."``."""
        return text_of(self._policy.new)

    def failure_report(self) -> Report | None:
        """What the failed saves not reported yet mean (on rank 0, which saves): a warning, or
        the error once ``max_consecutive_failures`` saves in a row failed."""
        return self._policy.report()

    def raise_failures(self, report: Report | None = None) -> None:
        """Warn about the failures kept so far, or raise them once ``max_consecutive_failures``
        saves in a row failed (``report``: rank 0's :meth:`failure_report`, on every rank).

        Raises:
            CheckpointError: naming every failed step of the streak and its error, chained from
                the first one's.
        """
        self._policy.apply(report)

    def log_failures(self) -> None:
        """Log the failures kept so far instead of raising them (another error is on its way)."""
        for what, error in self._policy.take():
            log.error("IncrementalCheckpoint: checkpoint %s failed: %s", what, error)

    def close(self, *, raise_errors: bool) -> None:
        """Wait for the saves in flight and stop the engine's threads.

        Raises:
            Exception: with ``raise_errors``, an error the engine had not delivered yet.
        """
        store, self.store = self.store, None
        if store is None:
            return
        try:
            store.close()
        except Exception:
            if raise_errors:
                raise
            log.exception("IncrementalCheckpoint: closing %s failed", store.url)

    def _report(self, result: SaveResult, blocked: float) -> None:
        self.last_committed = result.step
        self.results.append((result, blocked))
        totals = self.totals
        totals["saves"] += 1
        totals["bytes_written"] += result.bytes_written
        totals["bytes_logical"] += result.bytes_logical
        totals["blocked_s"] += blocked
        metrics = {
            f"{METRIC_PREFIX}bytes_written": float(result.bytes_written),
            f"{METRIC_PREFIX}bytes_logical": float(result.bytes_logical),
            f"{METRIC_PREFIX}ratio": result.ratio,
            f"{METRIC_PREFIX}blocked_s": blocked,
            f"{METRIC_PREFIX}save_s": result.total_s,
        }
        for logger in self.loggers:
            logger.log_metrics(metrics, step=result.step)


def _gather(trainer: pl.Trainer, state: dict[str, Any], everywhere: bool) -> list[Any] | None:
    """Every rank's ``state``, in rank order: on every rank when ``everywhere`` saves (a sharded
    store), else on rank 0 only (None elsewhere; each rank sends its own, nothing more)."""
    if trainer.world_size == 1:
        return [state]
    return collectives.gather(state) if everywhere else collectives.gather_to(state)
