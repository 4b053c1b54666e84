"""The integration installed on one ``Accelerator`` instance (:meth:`IncrementalCheckpointer.
take_over`): instance attributes that shadow its ``save_state`` / ``load_state`` /
``skip_first_batches``, and its prepared DataLoaders' own iteration routed through the
checkpointer's position tracking. The class and other accelerators are untouched.

``skip_first_batches(loader, n)`` on a tracked loader returns the loader itself: its next epoch
starts after ``n`` batches (skipped by index where the sampler allows, as Accelerate does) and
stays tracked, so a save inside it resumes exactly. Right after ``load_state()`` restored a
position inside an epoch, that epoch continues where the checkpoint stood; a script that computes
its own ``n`` (Accelerate's examples derive it from the checkpoint's name) gets a warning when
its count differs from the checkpoint's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from accelerate_incremental import _hooks, _tracking

if TYPE_CHECKING:
    from accelerate_incremental.checkpointer import IncrementalCheckpointer

_ATTRS = ("save_state", "load_state", "skip_first_batches", "_incremental_checkpointer")


def take_over(ckpt: IncrementalCheckpointer) -> None:
    """See :meth:`IncrementalCheckpointer.take_over`.

    Raises:
        RuntimeError: the accelerator is already taken over.
        TypeError: a prepared DataLoader whose iteration cannot be tracked.
    """
    acc = ckpt.accelerator
    if getattr(acc, "_incremental_checkpointer", None) is not None:
        raise RuntimeError("this accelerator's save_state/load_state are already taken over")

    def save_state(output_dir: Any = None, *args: Any, **kwargs: Any) -> str:
        iteration = acc.project_configuration.iteration
        weights = None
        if _hooks.save_hooks(acc):
            weights = _hooks.run_save_hooks(acc, output_dir, iteration)
        ckpt._save(iteration, iteration + 1, None, weights)
        ckpt._settle(block=True)  # on every process: all warn or raise alike
        ckpt.store.wait()
        acc.project_configuration.iteration = iteration + 1
        return str(ckpt.store.url)

    def load_state(input_dir: Any = None, *args: Any, **kwargs: Any) -> int | None:
        return ckpt.load(_pre_hooks=_hooks.load_hooks_for(acc, input_dir))

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        index = ckpt._index(dataloader)
        counted = isinstance(num_batches, int) and not isinstance(num_batches, bool)
        if index is None or not _tracking.is_tracked(dataloader) or not counted or num_batches < 0:
            return type(acc).skip_first_batches(acc, dataloader, num_batches)
        position = ckpt._position(index)
        pending = position.pending()
        if pending is None:
            position.skip_next(num_batches)
        elif pending != num_batches:
            warnings.warn(
                f"skip_first_batches(dataloader, {num_batches}) right after load_state(): the "
                f"restored checkpoint stood {pending} batches into this epoch of prepared "
                f"DataLoader {index}, so the epoch continues after batch {pending}, consistent "
                "with the restored weights; check how the script counts the batches to skip",
                UserWarning,
                stacklevel=2,
            )
        return dataloader

    acc.save_state = save_state
    acc.load_state = load_state
    acc.skip_first_batches = skip_first_batches
    acc._incremental_checkpointer = ckpt
    try:
        follow(ckpt)
    except TypeError:
        release(ckpt)
        raise


def follow(ckpt: IncrementalCheckpointer) -> None:
    """Track every prepared DataLoader of the taken-over accelerator not tracked yet.

    Raises:
        TypeError: a prepared DataLoader whose iteration cannot be tracked.
    """
    for loader in ckpt.accelerator._dataloaders:
        if not _tracking.is_tracked(loader):
            _tracking.track(loader, functools.partial(_epoch, ckpt, loader))


def _epoch(ckpt: IncrementalCheckpointer, loader: Any) -> Iterator[Any]:
    index = ckpt._index(loader)
    if index is None:  # no longer prepared (accelerator.free_memory): Accelerate's iteration
        return _tracking.own_iter(loader)
    return ckpt._epoch(index)


def release(ckpt: IncrementalCheckpointer) -> None:
    """See :meth:`IncrementalCheckpointer.release`."""
    acc = ckpt.accelerator
    if getattr(acc, "_incremental_checkpointer", None) is not ckpt:
        return
    for loader in acc._dataloaders:
        _tracking.untrack(loader)
    for name in _ATTRS:
        vars(acc).pop(name, None)
