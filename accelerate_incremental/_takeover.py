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

``load_state`` checks its arguments as Accelerate does and honours ``map_location``; those the
incremental restore cannot honour are refused (:func:`~._arguments.load_state_arguments`).

The taken-over accelerator and its loaders pickle and deep-copy as Accelerate's own do: a copy is
a plain accelerator (its own methods, untracked loaders, no checkpointer), since the
checkpointer's store and background work cannot be copied; take the copy over anew if needed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from accelerate_incremental import _compat, _hooks, _tracking
from accelerate_incremental._load_arguments import load_state_arguments
from accelerate_incremental._loaders import Loaders

_ATTR = "_incremental_checkpointer"  # on the accelerator instance: the checkpointer installed
_ATTRS = ("save_state", "load_state", "skip_first_batches", _ATTR)


@dataclass(frozen=True)
class Target:
    """What the takeover needs of a checkpointer, given by it (:meth:`IncrementalCheckpointer.
    take_over`).

    Attributes:
        owner: the checkpointer itself, recorded on the accelerator (:func:`installed`).
        accelerator: the ``Accelerator`` taken over.
        loaders: the positions of its prepared DataLoaders.
        epoch: ``epoch(index)`` is one tracked epoch of prepared DataLoader ``index`` (what a
            tracked loader's own ``for`` loop iterates).
        save: ``save(iteration, weights)`` saves checkpoint ``iteration`` on every process
            (``weights``: the models' state dicts after the save pre-hooks, or None), waits for
            its commit, warns about or raises failed saves alike everywhere, and returns the
            store's URL.
        load: ``load(pre_hooks, map_location)`` restores the newest checkpoint and returns its
            step (None for an empty store); ``pre_hooks`` (or None) runs the load pre-hooks given
            the step and returns the models the weights go to; ``map_location``: the store's.
    """

    owner: Any
    accelerator: Any
    loaders: Loaders
    epoch: Callable[[int], Iterator[Any]]
    save: Callable[[int, list[dict[str, Any]] | None], str]
    load: Callable[[Callable[[int], list[Any]] | None, Any], int | None]


class _Shadow:
    """One of the accelerator's methods, shadowed by the integration (an instance attribute).
    Pickled or deep-copied (with the accelerator), it is the copy's own method again."""

    def __init__(self, accelerator: Any, name: str, function: Callable[..., Any]) -> None:
        self._accelerator = accelerator
        self._name = name
        self._function = function
        functools.update_wrapper(self, getattr(type(accelerator), name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return getattr, (self._accelerator, self._name)


class _Installed:
    """The checkpointer recorded on the accelerator; a copy of the accelerator records none."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __reduce__(self) -> tuple[Any, ...]:
        return _nothing, ()


def _nothing() -> None:
    return None


def installed(accelerator: Any) -> Any:
    """The checkpointer that took ``accelerator`` over; None when none did."""
    record = getattr(accelerator, _ATTR, None)
    return record.owner if isinstance(record, _Installed) else None


def take_over(target: Target) -> None:
    """See :meth:`IncrementalCheckpointer.take_over`.

    Raises:
        RuntimeError: the accelerator is already taken over.
        TypeError: a prepared DataLoader whose iteration cannot be tracked.
    """
    acc = target.accelerator
    loaders = target.loaders
    if installed(acc) is not None:
        raise RuntimeError("this accelerator's save_state/load_state are already taken over")

    def save_state(output_dir: Any = None, *args: Any, **kwargs: Any) -> str:
        iteration = acc.project_configuration.iteration
        weights = None
        if _compat.save_state_pre_hooks(acc):
            weights = _hooks.run_save_hooks(acc, output_dir, iteration)
        url = target.save(iteration, weights)
        acc.project_configuration.iteration = iteration + 1
        return url

    def load_state(input_dir: Any = None, load_kwargs: Any = None, **kwargs: Any) -> int | None:
        location = load_state_arguments(acc, load_kwargs, kwargs)
        return target.load(_hooks.load_hooks_for(acc, input_dir), location)

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        index = loaders.index(dataloader)
        counted = isinstance(num_batches, int) and not isinstance(num_batches, bool)
        if index is None or not _tracking.is_tracked(dataloader) or not counted or num_batches < 0:
            return _compat.skip_first_batches(acc, dataloader, num_batches)
        position = loaders.position(index)
        pending = position.pending()
        if pending is None:
            position.skip_next(num_batches)
        elif pending != num_batches or position.pending_cut():
            goes_on = (
                "with this process's share of the samples it had left (cut anew for "
                f"{acc.num_processes} processes, see the resume's account)"
                if position.pending_cut()
                else f"after batch {pending}"
            )
            warnings.warn(
                f"skip_first_batches(dataloader, {num_batches}) right after load_state(): the "
                f"restored checkpoint stood {pending} batches into this epoch of prepared "
                f"DataLoader {index}, so the epoch continues {goes_on}, consistent with the "
                "restored weights; check how the script counts the batches to skip",
                UserWarning,
                stacklevel=2,
            )
        return dataloader

    for name, function in (
        ("save_state", save_state),
        ("load_state", load_state),
        ("skip_first_batches", skip_first_batches),
    ):
        setattr(acc, name, _Shadow(acc, name, function))
    setattr(acc, _ATTR, _Installed(target.owner))
    try:
        follow(target)
    except TypeError:
        release(target)
        raise


def follow(target: Target) -> None:
    """Track every prepared DataLoader of the taken-over accelerator not tracked yet.

    Raises:
        TypeError: a prepared DataLoader whose iteration cannot be tracked.
    """
    for loader in _compat.dataloaders(target.accelerator):
        if not _tracking.is_tracked(loader):
            _tracking.track(loader, functools.partial(_epoch, target, loader))


def _epoch(target: Target, loader: Any) -> Iterator[Any]:
    index = target.loaders.index(loader)
    if index is None:  # no longer prepared (accelerator.free_memory): Accelerate's iteration
        return _tracking.own_iter(loader)
    return target.epoch(index)


def release(target: Target) -> None:
    """See :meth:`IncrementalCheckpointer.release`."""
    acc = target.accelerator
    if installed(acc) is not target.owner:
        return
    for loader in _compat.dataloaders(acc):
        _tracking.untrack(loader)
    for name in _ATTRS:
        vars(acc).pop(name, None)
