"""Every use of a Lightning internal, in one module, checked against the Lightning versions we
support (:data:`OLDEST_SUPPORTED` to :data:`NEWEST_TESTED`; CI runs the adapter's quick tests
against the oldest as well as the current release).

The adapters need a few things Lightning has no public API for: taking the place of the
checkpoint connector's ``resume_start`` (to resume from the store when ``fit`` has no
``ckpt_path``), ``dump_checkpoint`` (the dict ``trainer.save_checkpoint`` would write), the fit
loop's progress counters, data fetcher and combined loader (the position in the epoch), its
restart flags, and the logged-metric aggregates. Where versions differ (``resume_start`` gained
``weights_only`` in 2.5), the difference is handled here, once.

Lightning's loop state around a checkpoint — what a resumed run needs to continue as the
uninterrupted run did. Lightning resumes from a checkpoint by re-entering its loops at the stage
their progress counters describe ("restarting"). Two of those stages do not continue the way the
uninterrupted run did:

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
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _load as fabric_load
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH, _Stateful
from lightning.pytorch.core.saving import _default_map_location, _load_state
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher, _PrefetchDataFetcher
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.overrides.distributed import _DatasetSamplerWrapper
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

from lightning_incremental.lightning.compat_signals import (  # noqa: F401 (the compat surface)
    hold_sigterm,
    ignore_signals_after_fit,
    is_sigterm,
    received_sigterm,
    signal_handler_without_collectives,
    slurm_auto_requeue,
    stop_as_on_sigterm,
)
from lightning_incremental.lightning.hparams import plain_hyperparameters, typed_hyperparameters

#: The oldest Lightning release the adapter supports (CI runs its quick tests against it).
OLDEST_SUPPORTED = (2, 5)
#: The newest Lightning minor release the adapter is tested with.
NEWEST_TESTED = (2, 6)


def parse_version(text: str) -> tuple[int, int]:
    """``"2.6.1"`` → ``(2, 6)``; ``"2.7.0rc1"`` → ``(2, 7)``. A part without digits counts as 0."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits) if digits else 0)
    parts += [0] * (2 - len(parts))
    return parts[0], parts[1]


def check_version(version: str) -> None:
    """Refuse a Lightning older than :data:`OLDEST_SUPPORTED` (an ImportError naming the fix);
    warn for one newer than :data:`NEWEST_TESTED` (the internals used here may have moved)."""
    found = parse_version(version)
    if found < OLDEST_SUPPORTED:
        oldest = "{}.{}".format(*OLDEST_SUPPORTED)
        raise ImportError(
            f"lightning-incremental's Lightning adapter needs lightning>={oldest}, found "
            f"{version}: pip install -U 'lightning>={oldest}'"
        )
    if found > NEWEST_TESTED:
        newest = "{}.{}".format(*NEWEST_TESTED)
        warnings.warn(
            f"lightning-incremental is tested with Lightning up to {newest}.x, "
            f"found {version}: a Lightning internal it relies on may have changed",
            stacklevel=2,
        )


LIGHTNING_VERSION: str = lightning.__version__
check_version(LIGHTNING_VERSION)

# Private Lightning types the data-position code recognises.
Stateful = _Stateful
DataLoaderIterDataFetcher = _DataLoaderIterDataFetcher
PrefetchDataFetcher = _PrefetchDataFetcher
DatasetSamplerWrapper = _DatasetSamplerWrapper

# --- loading a module from a checkpoint dict (what ``load_from_checkpoint`` does after reading)

PathLike = _PATH
MapLocation = _MAP_LOCATION_TYPE
default_map_location = _default_map_location
load_state = _load_state


def torch_load_checkpoint(path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """``TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)``. Lightning
    before 2.6 has no ``weights_only`` there and always loads with ``weights_only=False``; a
    ``weights_only=True`` asked for is honoured all the same."""
    plugin = TorchCheckpointIO()
    if _takes_weights_only(plugin.load_checkpoint):
        return plugin.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    if not weights_only:
        return plugin.load_checkpoint(path, map_location=map_location)
    if not get_filesystem(path).exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return fabric_load(path, map_location=map_location, weights_only=True)


# --- the checkpoint connector -------------------------------------------------------------------

#: ``original(path)``: Lightning's own ``resume_start`` for ``path``.
Original = Callable[[Any], None]


def _takes_weights_only(function: Callable[..., Any]) -> bool:
    try:
        return "weights_only" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # pragma: no cover - a callable without a signature
        return False


def replace_resume_start(
    trainer: pl.Trainer, replacement: Callable[[Any, Original], None]
) -> Callable[[], None]:
    """Make the trainer's checkpoint connector call ``replacement(checkpoint_path, original)``
    where Lightning calls ``resume_start``; ``original(path)`` runs Lightning's own (passing the
    call's ``weights_only`` on the versions that have it). Returns the function that undoes it."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start
    resume_start: Callable[..., None]
    if _takes_weights_only(original):

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            replacement(checkpoint_path, lambda path: original(path, weights_only=weights_only))

    else:

        def resume_start(checkpoint_path: Any = None) -> None:
            replacement(checkpoint_path, original)

    connector.resume_start = resume_start  # type: ignore[method-assign,assignment]

    def undo() -> None:
        if connector.__dict__.get("resume_start") is resume_start:
            del connector.resume_start

    return undo


def set_loaded_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any], where: str) -> None:
    """Hand ``checkpoint`` to the checkpoint connector as ``resume_start`` does after reading a
    file at ``where`` (upgraded by Lightning's migrations first)."""
    connector = trainer._checkpoint_connector
    connector._ckpt_path = where
    connector._loaded_checkpoint = migrate_checkpoint(typed_hyperparameters(checkpoint))


def migrate_checkpoint(checkpoint: dict[str, Any], path: Any = None) -> dict[str, Any]:
    """Lightning's upgrade of a checkpoint dict written by an older Lightning, in place."""
    return _pl_migrate_checkpoint(checkpoint, path)


def dump_checkpoint(
    trainer: pl.Trainer,
    *,
    model_state: Callable[[], dict[str, Any]] | None = None,
    optimizer_state: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The complete dict ``trainer.save_checkpoint`` would write. ``model_state`` /
    ``optimizer_state(optimizer)`` take the place of the strategy's
    ``lightning_module_state_dict`` / ``optimizer_state`` during the dump (instance attributes,
    removed afterwards): a sharded strategy's own may gather the full state to rank 0.
    OmegaConf hyper-parameters come out as plain containers (see :mod:`~.hparams`)."""
    strategy = trainer.strategy
    replaced = {"lightning_module_state_dict": model_state, "optimizer_state": optimizer_state}
    replaced = {name: f for name, f in replaced.items() if f is not None}
    for name, function in replaced.items():
        setattr(strategy, name, function)
    try:
        dump = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return plain_hyperparameters(dump)  # OmegaConf configs as plain containers
    finally:
        for name in replaced:
            strategy.__dict__.pop(name, None)


def saving_trainer() -> pl.Trainer | None:
    """The trainer whose ``Trainer.save_checkpoint`` this call comes from (the innermost such
    frame on this thread's stack), or None."""
    code = pl.Trainer.save_checkpoint.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, pl.Trainer):
                return trainer
        frame = frame.f_back  # type: ignore[assignment]
    return None


def raw_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ``LightningOptimizer`` wraps (its ``_optimizer``); any other
    optimizer itself."""
    return getattr(optimizer, "_optimizer", optimizer)


def strategy_fitted(strategy: Any) -> bool:
    """Whether the trainer of ``strategy``'s LightningModule ran ``fit``."""
    from lightning.pytorch.trainer.states import TrainerFn

    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def tearing_down_strategy() -> Any:
    """The Lightning ``Strategy`` whose ``teardown`` this call comes from (the innermost such
    frame on this thread's stack), or None: Lightning gives a ``CheckpointIO`` no view of it."""
    from lightning.pytorch.strategies import Strategy

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "teardown":
            strategy = frame.f_locals.get("self")
            if isinstance(strategy, Strategy):
                return strategy
        frame = frame.f_back  # type: ignore[assignment]
    return None


def trainer_stage_running() -> bool | None:
    """Whether the ``Trainer.save_checkpoint`` call this save comes from happens while the
    trainer runs ``fit/validate/test/predict``; None when the save does not come from
    ``Trainer.save_checkpoint`` (a direct call, a strategy's launcher).

    Lightning gives a ``CheckpointIO`` no view of the trainer, so the call's own frame is read:
    the innermost ``Trainer.save_checkpoint`` frame on this thread's stack and its ``self``.
    """
    from lightning.pytorch.trainer.states import TrainerStatus

    trainer = saving_trainer()
    return None if trainer is None else bool(trainer.state.status == TrainerStatus.RUNNING)


# --- the fit loop's data and counters -----------------------------------------------------------


def combined_loader(trainer: pl.Trainer) -> Any:
    """The fit loop's ``CombinedLoader`` (None before its setup)."""
    return trainer.fit_loop._combined_loader


def loader_states(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """This rank's stateful training loaders' states, as the fit loop saves them (rank 0's go
    into the checkpoint's ``loops``); empty when there is none."""
    combined = combined_loader(trainer)
    return combined._state_dicts() if combined is not None else []


def put_loader_states(checkpoint: dict[str, Any], states: list[dict[str, Any]]) -> None:
    """Make the fit loop restore ``states`` into the stateful training loaders when it loads
    ``checkpoint`` (it applies them in its data setup, before any hook of the resumed fit)."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if isinstance(fit, dict) and isinstance(fit.get("state_dict"), dict):
        fit["state_dict"]["combined_loader"] = states


def combined_iterator(trainer: pl.Trainer) -> Any:
    """The object Lightning iterates this epoch; a new one each time it recreates the iterator."""
    combined = combined_loader(trainer)
    return getattr(combined, "_iterator", None) if combined is not None else None


def data_fetcher(trainer: pl.Trainer) -> Any:
    """The fit loop's data fetcher (None before its setup)."""
    return trainer.fit_loop._data_fetcher


def skip_sampled_batches(trainer: pl.Trainer, batches: int) -> int:
    """Advance the epoch's (single, map-style) loader past ``batches`` batches by drawing only
    its sampler's indices — no data is loaded — and count them as yielded. Returns how many were
    skipped (fewer when the sampler ran out)."""
    iterator = combined_iterator(trainer)
    loader_iter = iterator.iterators[0]
    done = 0
    for _ in range(batches):
        try:
            next(loader_iter._sampler_iter)
        except StopIteration:
            break
        done += 1
    loader_iter._num_yielded += done
    iterator._idx += done
    return done


def uncount_fetched(fetcher: Any, batches: int) -> None:
    """``batches`` were fetched only to skip them: the epoch loop adds the batches it counts as
    consumed to the fetcher's ``fetched`` itself, so these must not count twice."""
    fetcher.fetched -= batches


def batches_ready(trainer: pl.Trainer) -> int:
    """Batches of the current epoch the fit loop has made ready."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def epoch_length(trainer: pl.Trainer) -> tuple[int | float, Any, Any]:
    """The batches of the current training epoch (``trainer.num_training_batches``), the batch
    count that runs validation (``trainer.val_check_batch``) and the combined loader's per-loader
    limits (``setup_data`` caps each loader's length with them)."""
    loop = trainer.fit_loop
    combined = loop._combined_loader
    return loop.max_batches, trainer.val_check_batch, combined.limits if combined else None


def set_epoch_length(
    trainer: pl.Trainer, batches: int | float, val_check_batch: Any, limits: Any
) -> None:
    """Set what :func:`epoch_length` returns: with ``limits`` ``[batches]``, the (single)
    training loader's epoch ends after ``batches`` batches."""
    loop = trainer.fit_loop
    loop.max_batches = batches
    trainer.val_check_batch = val_check_batch
    if loop._combined_loader is not None:
        loop._combined_loader.limits = limits


def batch_progress_total(trainer: pl.Trainer) -> Any:
    """The fit loop's batch counters over all epochs (``ready``/``started``/``processed``/
    ``completed``)."""
    return trainer.fit_loop.epoch_loop.batch_progress.total


# --- the fit loop's restart state and logged metrics --------------------------------------------


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


def refuse_wrapping(checkpoint_io: object) -> None:
    """Refuse a call to ``checkpoint_io`` that comes through Lightning's ``AsyncCheckpointIO``
    (any ``_WrappingCheckpointIO`` whose ``checkpoint_io`` it is: a frame of this thread's stack
    whose ``self`` is one; its save thread's frame holds it too).

    Raises:
        ConfigError: the call comes through such a wrapper.
    """
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    from lightning_incremental.core import ConfigError

    frame = sys._getframe(1)
    while frame is not None:
        wrapper = frame.f_locals.get("self")
        if isinstance(wrapper, _WrappingCheckpointIO) and wrapper.checkpoint_io is checkpoint_io:
            raise ConfigError(
                f"{type(checkpoint_io).__name__} cannot be wrapped in Lightning's "
                f"{type(wrapper).__name__}: it already saves in the background (and orders its "
                "removals after its saves, and waits for them at teardown, which "
                f"{type(wrapper).__name__} neither does nor forwards); drop AsyncCheckpointIO "
                f"and pass the plug-in itself: Trainer(plugins=[{type(checkpoint_io).__name__}"
                "(...)])"
            )
        frame = frame.f_back  # type: ignore[assignment]
