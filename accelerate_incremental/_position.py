"""Where a process stands in a prepared DataLoader's epoch, and how a resumed run gets back there.

A shuffled epoch's order is a function of the random state when its iterator starts: the
``torch.Generator`` of the sampler (which Accelerate broadcasts from the main process at every
``__iter__`` in multi-process runs) or, without one, the global torch random state. Accelerate's
own checkpoints keep neither for a mid-epoch resume. :class:`LoaderPosition` records both at the
start of each epoch, counts the batches handed to the training loop, and on resume puts the
states back and skips the consumed batches with ``accelerator.skip_first_batches`` (which advances
the sampler without loading the skipped samples for map-style datasets).

Everything it returns is plain data (tensors, ints) for checkpoints. Framework-free apart from
duck-typed attributes of Accelerate's DataLoader wrappers (``iteration``,
``synchronized_generator``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_incremental.runtime.state import data_position as position

_FOLLOW = ("base_dataloader", "batch_sampler", "sampler", "dataset")
_MAX_DEPTH = 5


def generators(loader: Any) -> dict[str, torch.Generator]:
    """Every distinct ``torch.Generator`` a prepared loader, its samplers or its dataset draw from,
    by attribute path (``"synchronized_generator"``, ``"batch_sampler.sampler.generator"``)."""
    return position.find_generators(
        loader,
        names=("synchronized_generator", "generator"),
        follow=_FOLLOW,
        max_depth=_MAX_DEPTH,
        accept=lambda value: not isinstance(value, (str, bytes, int, float)),
    )


def _epoch(loader: Any) -> int:
    value = getattr(loader, "iteration", 0)
    return value if isinstance(value, int) else 0


@dataclass
class _Resume:
    epoch: int
    consumed: int
    torch_state: torch.Tensor
    generator_states: dict[str, torch.Tensor]
    # resumed on another number of processes (see _resize): this process's batches of the
    # epoch's rest, and what the next checkpoints of the epoch record about it
    batches: list[list[int]] | None = None
    cut: dict[str, Any] | None = None


class LoaderPosition:
    """Tracks one prepared DataLoader. ``iterate`` is the training loop's view of it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = _epoch(loader)
        self.consumed: int | None = None  # batches handed out this epoch; None: not in an epoch
        self._torch_state: torch.Tensor | None = None
        self._generator_states: dict[str, torch.Tensor] = {}
        self._resume: _Resume | None = None
        self._skip = 0  # batches the next fresh epoch starts after (skip_next)
        self._cut: dict[str, Any] | None = None  # the epoch in progress was cut anew (_resize)
        self._length: int | None = None  # its batches, done ones included

    def state(self) -> dict[str, Any]:
        """Plain data: the epoch, the batches consumed in it, and its starting random states."""
        resume = self._resume
        if resume is not None:  # restored, its epoch not begun yet: still the saved position
            return {
                "epoch": resume.epoch,
                "consumed": resume.consumed,
                "torch": resume.torch_state,
                "generators": dict(resume.generator_states),
                **(resume.cut or {}),
            }
        now = position.generator_states(generators(self.loader))
        if self.consumed is None or self._torch_state is None:
            return {"epoch": _epoch(self.loader), "consumed": None, "generators": now}
        if self.at_epoch_end():
            # Every batch of the epoch is out and its order fully drawn: the state is that of
            # the next epoch's start, so a resumed run goes on with that epoch whatever its loop
            # derives the epoch from (the work a script does after the batch loop is not in it).
            return {"epoch": self.epoch + 1, "consumed": None, "generators": now}
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "torch": self._torch_state,
            "generators": dict(self._generator_states),
            **(self._cut or {}),
        }

    def at_epoch_end(self) -> bool:
        """Whether the loop holds the epoch's last batch (the loader's length is known and every
        batch of the epoch was handed out)."""
        if self.consumed is None:
            return False
        try:
            return self.consumed >= (self._length if self._length is not None else len(self.loader))
        except TypeError:  # no length (an iterable dataset)
            return False

    def restore(self, state: dict[str, Any]) -> None:
        """Arrange for the next ``iterate`` to continue the saved epoch where it stood.

        Raises:
            ValueError: ``state`` is not a saved position of this loader.
        """
        try:
            epoch = int(state["epoch"])
            consumed = state["consumed"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a saved data position: {state!r:.200}") from exc
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = epoch
        self.epoch = epoch
        self.consumed = None
        self._resume = None
        saved = dict(state["generators"])
        current = generators(self.loader)
        if sorted(saved) != sorted(current):
            raise ValueError(
                "the DataLoader's random generators differ from the checkpoint's: saved "
                f"{sorted(saved)}, now {sorted(current)}; build the DataLoader as the saved run did"
            )
        if consumed is None:  # between epochs: the next epoch draws from the current states
            position.set_generator_states(current, saved)
            return
        self._resume = _Resume(epoch, int(consumed), state["torch"], saved)
        if isinstance(getattr(self.loader, "dataset", None), IterableDataset):
            warnings.warn(
                f"the checkpoint stood {consumed} batches into an epoch of a DataLoader over an "
                f"IterableDataset ({type(self.loader.dataset).__name__}), which has no saved "
                "position: the resumed epoch reads and discards those batches again, and "
                "continues exactly only if the dataset yields the same samples in the same order "
                "as in the saved run",
                UserWarning,
                stacklevel=2,
            )

    def restore_cut(
        self, state: dict[str, Any], batches: list[list[int]], cut: dict[str, Any]
    ) -> None:
        """Arrange for the next ``iterate`` to continue the saved epoch (``state``: the main
        process's position in it) on this process's ``batches`` of its rest, cut for another
        number of processes (see :mod:`~._resize`); ``cut`` is recorded by the next saves."""
        epoch = int(state["epoch"])
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = epoch
        self.epoch, self.consumed = epoch, None
        saved = dict(state["generators"])
        self._resume = _Resume(
            epoch, int(state["consumed"]), state["torch"], saved, batches=batches, cut=cut
        )

    def restore_boundary(self, state: dict[str, Any]) -> None:
        """The saved position is between epochs, saved by another number of processes: the next
        epoch draws from the saved generator states where this loader has the same ones."""
        epoch = int(state["epoch"])
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = epoch
        self.epoch, self.consumed, self._resume = epoch, None, None
        current = generators(self.loader)
        position.set_generator_states(current, dict(state["generators"]))

    def pending(self) -> int | None:
        """The consumed batches a restored, interrupted epoch continues after; None if none."""
        return None if self._resume is None else self._resume.consumed

    def pending_cut(self) -> bool:
        """Whether the restored epoch continues on a share of its rest (see :meth:`restore_cut`)
        rather than after its consumed batches."""
        return self._resume is not None and self._resume.batches is not None

    def skip_next(self, batches: int) -> None:
        """Start the next epoch after its first ``batches`` batches (the script's own skip,
        ``accelerator.skip_first_batches``), still tracking the position within it."""
        self._skip = batches

    def iterate(
        self,
        open_epoch: Callable[[int], Iterable[Any]],
        restore_now: Callable[[], None],
        open_batches: Callable[[list[list[int]]], Iterable[Any]] | None = None,
    ) -> Iterator[Any]:
        """Yield the epoch's batches; a resumed epoch continues after its consumed batches.

        ``open_epoch(n)`` returns the loader's epoch without its first ``n`` batches (the
        loader's own iteration for 0); ``open_batches(batches)`` the loader over exactly these
        batches of sample indices (an epoch cut anew, see :meth:`restore_cut`). ``restore_now``
        puts back the process's random state as it was at the save; it runs once the resumed
        epoch's iterator has drawn its order."""
        resume, self._resume = self._resume, None
        skip, self._skip = self._skip, 0
        if resume is None:
            self.epoch = _epoch(self.loader)
            self._torch_state = torch.get_rng_state()
            self._generator_states = position.generator_states(generators(self.loader))
            self.consumed = skip
            yield from self._count(iter(open_epoch(skip)), skip)
            if skip and hasattr(self.loader, "iteration"):  # another loader ran the epoch
                self.loader.iteration = self.epoch + 1
        else:
            self.epoch = resume.epoch
            self._torch_state = resume.torch_state
            self._generator_states = resume.generator_states
            self.consumed = resume.consumed
            if resume.batches is None:
                torch.set_rng_state(resume.torch_state.cpu())
                position.set_generator_states(generators(self.loader), resume.generator_states)
                source = iter(open_epoch(resume.consumed))
            else:  # cut anew for this number of processes: its order is in the batches
                assert open_batches is not None, "a cut epoch needs open_batches"
                self._cut, self._length = resume.cut, resume.consumed + len(resume.batches)
                source = iter(open_batches(resume.batches))
            try:
                first = next(source)
            except StopIteration:
                restore_now()
            else:
                restore_now()
                self.consumed += 1
                yield first
                yield from self._count(source, self.consumed)
            if hasattr(self.loader, "iteration"):
                self.loader.iteration = resume.epoch + 1
        self.consumed, self._cut, self._length = None, None, None

    def _count(self, source: Iterator[Any], start: int) -> Iterator[Any]:
        self.consumed = start
        for batch in source:
            self.consumed += 1
            yield batch
