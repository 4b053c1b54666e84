"""Saving a trainer's checkpoint through the engine, and what becomes of the saves.

:class:`Saver` takes one checkpoint (every rank takes part: each rank's random state and data
position are gathered, the trainer's own checkpoint dump runs everywhere), hands it to the
:class:`~lightning_incremental.core.CheckpointStore` on global rank 0 — which blocks only for the
snapshot — and later collects the results: figures to the trainer's loggers, errors kept until
the next save or the end of training, where every rank raises them alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger

from lightning_incremental._resume import FORMAT, KEY, _describe
from lightning_incremental.core import CheckpointError, CheckpointStore, SaveHandle, SaveResult

log = logging.getLogger(__name__)

METRIC_PREFIX = "incremental_checkpoint/"


class Saver:
    """One ``fit``'s saves: ``store`` is the engine on global rank 0 (None on the other ranks),
    ``totals`` the running figures kept across runs (updated in place), ``loggers`` where the
    figures of each committed save go."""

    def __init__(
        self,
        store: CheckpointStore | None,
        url: str,
        totals: dict[str, Any],
        loggers: list[Logger],
    ) -> None:
        self.store = store
        self.url = url
        self.totals = totals
        self.loggers = loggers
        self.results: list[tuple[SaveResult, float]] = []  # with the seconds training blocked
        self.last_committed: int | None = None
        self._pending: list[tuple[SaveHandle, float]] = []
        self._failures: list[tuple[int, BaseException]] = []

    def save(
        self,
        trainer: pl.Trainer,
        *,
        step: int,
        reason: str,
        boundary: bool,
        rank_state: dict[str, Any],
    ) -> None:
        """Save the trainer's checkpoint as ``step``, with every rank's ``rank_state``. Call on
        every rank at once: it gathers and broadcasts.

        Raises:
            CheckpointError: an earlier save failed (on every rank), or this one could not start.
            Exception: the engine's own error for this save on rank 0 (``UnsupportedValueError``
                naming the key that needs pickling, ...).
        """
        started = time.perf_counter()
        self.collect(block=False)  # errors of earlier saves surface here
        states = _gather(trainer, rank_state)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        error: BaseException | None = None
        handle = None
        if trainer.is_global_zero and not self._failures:
            assert self.store is not None
            checkpoint[KEY] = {"format": FORMAT, "world_size": trainer.world_size, "ranks": states}
            metadata = {
                "epoch": trainer.current_epoch,
                "global_step": step,
                "reason": reason,
                "epoch_boundary": boundary,
            }
            try:
                handle = self.store.save(
                    checkpoint, step, metadata=metadata, world_size=trainer.world_size
                )
            except Exception as exc:
                error = exc
            if error is not None:  # an earlier save's error, delivered by the engine now?
                self.collect(block=False)
                if any(failed is error for _, failed in self._failures):
                    error = None
        text = trainer.strategy.broadcast(self.failure_text() or _describe(error), src=0)
        if self._failures:
            self.raise_failures()
        if error is not None:
            raise error
        if text is not None:
            raise CheckpointError(f"rank 0 failed to save checkpoint step {step}: {text}")
        if handle is not None:
            self._pending.append((handle, time.perf_counter() - started))

    def collect(self, *, block: bool) -> list[SaveResult]:
        """Report the saves that finished (all of them with ``block``); keep their errors."""
        results, still = [], []
        for handle, blocked in self._pending:
            if not block and not handle.done():
                still.append((handle, blocked))
                continue
            error = handle.exception()
            if error is not None:
                self._failures.append((handle.step, error))
                continue
            result = handle.wait()
            results.append(result)
            self._report(result, blocked)
        self._pending = still
        return results

    def failure_text(self) -> str | None:
        if not self._failures:
            return None
        return "; ".join(f"step {step}: {_describe(error)}" for step, error in self._failures)

    def raise_failures(self, text: str | None = None) -> None:
        """Raise the failures kept so far (``text``: rank 0's, on the other ranks).

        Raises:
            CheckpointError: naming every failed step and its error.
        """
        failures, text = self._failures, text or self.failure_text()
        self._failures = []
        if not text:
            return
        cause = failures[0][1] if failures else None
        raise CheckpointError(f"IncrementalCheckpoint: saving to {self.url} failed: {text}") from (
            cause
        )

    def log_failures(self) -> None:
        """Log the failures kept so far instead of raising them (another error is on its way)."""
        for step, error in self._failures:
            log.error("IncrementalCheckpoint: checkpoint step %d failed: %s", step, error)
        self._failures = []

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


def _gather(trainer: pl.Trainer, state: dict[str, Any]) -> list[Any]:
    """Every rank's ``state``, in rank order, on every rank."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [state]
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, state)
    return out
