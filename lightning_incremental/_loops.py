"""Lightning's loop state around a checkpoint: what a resumed run needs to continue as the
uninterrupted run did.

Lightning resumes from a checkpoint by re-entering its loops at the stage their progress counters
describe ("restarting"). Two of those stages do not continue the way the uninterrupted run did:

* **Between epochs.** A checkpoint taken in ``on_train_epoch_end`` says "epoch N processed, not
  completed"; when a run is iteration-based (``max_steps``), Lightning restarts *inside* epoch N:
  it keeps epoch N's batch counters, trains the next epoch's first batch as batch N·k of epoch N,
  then starts epoch N+1 and trains that batch again. And the work Lightning does after the
  callbacks' ``on_train_epoch_end`` — stepping ``ReduceLROnPlateau`` schedulers, completing the
  epoch — is missing from such a checkpoint. So ``IncrementalCheckpoint`` takes an epoch-boundary
  checkpoint once the epoch is over (at the next epoch's start, or when training ends), records it
  as a state between epochs (:func:`between_epochs`), and a resumed run starts the next epoch
  exactly as the uninterrupted run did (:func:`start_next_epoch`): from fresh counters, with
  Lightning creating the epoch's iterator after the epoch-start hooks.
* **The first epoch after a mid-epoch resume.** Lightning skips ``ReduceLROnPlateau`` at the end
  of the epoch it restarted in, because the metrics of that epoch's first part are not in its
  checkpoints. The resumed epoch runs to its end here, with its validation: the scheduler must
  step as it did uninterrupted (:func:`finish_restart`), from the same figures: the epoch's
  running aggregates of logged values and the callback metrics are part of the checkpoint
  (:func:`logged_state`, :func:`restore_logged`).

Every use of these private attributes of Lightning's loops is in this module.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.loop import _Loop


def between_epochs(checkpoint: dict[str, Any]) -> None:
    """Make ``checkpoint`` (a dump of ``trainer.save_checkpoint``'s contents) describe the state
    between two epochs: the last one complete, the next one not begun. In place."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit, dict):
        return
    progress = fit.get("epoch_progress")
    if not isinstance(progress, dict):
        return
    for part in ("total", "current"):
        counts = progress.get(part)
        if isinstance(counts, dict) and "processed" in counts:
            done = counts["processed"]
            counts.update(ready=done, started=done, completed=done)


def start_next_epoch(trainer: pl.Trainer) -> None:
    """In a run resumed from a checkpoint :func:`between_epochs`: leave Lightning's restart mode,
    so the next epoch begins as in an uninterrupted run — fresh batch counters, the epoch-start
    hooks, then the epoch's data iterator created by Lightning (after those hooks, from the random
    state they leave). Call in ``on_train_start``."""
    loop = trainer.fit_loop
    _Loop.restarting.fset(loop, False)  # type: ignore[attr-defined]  # and every child loop
    loop._resuming_from_checkpoint = False
    loop.reset_restart_stage()
    loop.epoch_loop.reset_restart_stage()


def finish_restart(trainer: pl.Trainer) -> None:
    """After a mid-epoch resume, once the resumed epoch's first batch runs: the fit loop is no
    longer restarting, so the epoch's end steps ``ReduceLROnPlateau`` schedulers as in the
    uninterrupted run."""
    trainer.fit_loop._restarting = False


def max_steps_reached(trainer: pl.Trainer) -> bool:
    """Whether this optimizer step ends training (``max_steps``)."""
    max_steps = trainer.max_steps
    return max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps


def epoch_ends_here(trainer: pl.Trainer) -> bool:
    """Whether the batch just trained is the epoch's last."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs a validation after the batch just trained."""
    epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(epoch_loop._should_check_val_fx(fetcher))


def logged_state(trainer: pl.Trainer, *, running: bool) -> dict[str, Any]:
    """What the metrics logged so far in this epoch hold, as plain data: the running epoch
    aggregates of the values logged with ``on_epoch=True`` during training (what a
    ``ReduceLROnPlateau``, ``EarlyStopping`` or ``ModelCheckpoint`` monitoring them reads at the
    epoch's end), and ``trainer.callback_metrics`` (the latest validation's, among others). A
    resumed run restarts with neither; :func:`restore_logged` puts them back. ``running``: the
    epoch is in progress (between epochs, the aggregates belong to the finished epoch)."""
    aggregates: dict[str, dict[str, Any]] = {}
    for key, metric in trainer.fit_loop.epoch_loop._results.items() if running else ():
        if not getattr(metric, "is_tensor", False) or not metric.meta.on_epoch:
            continue
        entry = {"value": metric.value.detach().clone()}
        if metric.meta.is_mean_reduction:
            entry["cumulated_batch_size"] = metric.cumulated_batch_size.detach().clone()
        aggregates[key] = entry
    callback = {
        name: value.detach().clone()
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, torch.Tensor)
    }
    return {"running": aggregates, "callback_metrics": callback}


def restore_logged(trainer: pl.Trainer, saved: dict[str, Any] | None) -> None:
    """Put back what :func:`logged_state` recorded (call in ``on_train_start``). An epoch
    aggregate resumes with the next value logged under its key: that value is combined with the
    saved aggregate in the order the uninterrupted run used, so the epoch's figure is bit-equal."""
    if not saved:
        return
    connector = trainer._logger_connector
    connector._callback_metrics.update(saved.get("callback_metrics") or {})
    pending = dict(saved.get("running") or {})
    if not pending:
        return
    results = trainer.fit_loop.epoch_loop._results
    original = results.log

    def log(fx: str, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        fresh = set(pending).difference(results)
        original(fx, name, value, *args, **kwargs)
        for key in fresh.intersection(results):  # registered by this call, from defaults
            _resume_aggregate(results[key], pending.pop(key))
        if not pending:
            del results.log  # back to the class's method

    results.log = log


def _resume_aggregate(metric: Any, saved: dict[str, Any]) -> None:
    """``metric`` holds exactly one value (its first update from the default); make it hold the
    saved aggregate updated with that value, as the uninterrupted run computed it."""
    if not getattr(metric, "is_tensor", False) or not metric.meta.on_epoch:
        return
    meta = metric.meta
    previous = saved["value"].to(metric.value.device)
    if meta.is_mean_reduction and "cumulated_batch_size" in saved:
        metric.value = previous + metric.value  # value was 0.0 + v·b
        metric.cumulated_batch_size = (
            saved["cumulated_batch_size"].to(metric.value.device) + metric.cumulated_batch_size
        )
    elif meta.is_sum_reduction:
        metric.value = previous + metric.value
    elif meta.is_max_reduction or meta.is_min_reduction:
        metric.value = meta.reduce_fx(previous, metric.value)
