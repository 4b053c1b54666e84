"""The positions of one accelerator's prepared DataLoaders: which prepared loader an object is,
its :class:`~accelerate_incremental._position.LoaderPosition`, and one tracked epoch of it (the
iteration of :meth:`IncrementalCheckpointer.iterate` and of a taken-over loader's own ``for``
loop)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from accelerate_incremental import _compat, _tracking
from accelerate_incremental._position import LoaderPosition
from lightning_incremental.runtime import rng
from lightning_incremental.runtime.watchdog import Watchdog


class Loaders:
    """Tracks every prepared DataLoader of ``accelerator`` by its index in ``prepare`` order."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._positions: dict[int, LoaderPosition] = {}
        self._saved_rng: dict[str, Any] | None = None  # this process's RNG at the loaded save

    def index(self, dataloader: Any) -> int | None:
        """``dataloader``'s index among the prepared DataLoaders; None when not prepared."""
        loaders = _compat.dataloaders(self.accelerator)
        return next((i for i, dl in enumerate(loaders) if dl is dataloader), None)

    def position(self, index: int) -> LoaderPosition:
        """The position in prepared DataLoader ``index`` (a new one when that loader changed)."""
        loader = _compat.dataloaders(self.accelerator)[index]
        position = self._positions.get(index)
        if position is None or position.loader is not loader:
            position = self._positions[index] = LoaderPosition(loader)
        return position

    def states(self) -> list[dict[str, Any]]:
        """Every prepared DataLoader's position, as plain data for a checkpoint."""
        count = len(_compat.dataloaders(self.accelerator))
        return [self.position(i).state() for i in range(count)]

    def at_epoch_end(self) -> set[int]:
        """The indices of the loaders whose loop holds its epoch's last batch."""
        return {i for i, position in self._positions.items() if position.at_epoch_end()}

    def restore(self, positions: list[dict[str, Any]], saved_rng: dict[str, Any]) -> None:
        """Put back the loaders' saved ``positions``; ``saved_rng`` is this process's random state
        at the save, put back again once a resumed epoch's iterator has drawn its order.

        Raises:
            ValueError: a saved position does not fit its loader.
        """
        for i, position in enumerate(positions):
            self.position(i).restore(position)
        self._saved_rng = saved_rng

    def epoch(
        self,
        index: int,
        *,
        before: Callable[[], None],
        watchdog: Callable[[], Watchdog | None],
        boundary: Callable[[], None] = lambda: None,
    ) -> Iterator[Any]:
        """One epoch of prepared DataLoader ``index``, its position tracked. ``before`` runs when
        the epoch starts (before its iterator is created); then ``watchdog()`` gives the
        watchdog told of every batch handed out (None: none runs). ``boundary`` runs before
        each batch is fetched, the first too, but not before the end of an epoch of known
        length (its end-of-epoch work is still to come: the next epoch's first batch is the
        boundary) — every process fetches as many batches, so every one runs it as often."""
        position = self.position(index)
        loader = position.loader

        def open_epoch(skip: int) -> Any:
            if skip == 0:
                return _tracking.own_iter(loader)
            return _compat.skip_first_batches(self.accelerator, loader, skip)

        def restore_now() -> None:
            if self._saved_rng is not None:
                rng.restore(self._saved_rng)

        before()
        dog = watchdog()
        batches = position.iterate(open_epoch, restore_now)
        while True:
            if not position.at_epoch_end():
                boundary()  # the batch before it is done, this one not fetched yet
            try:
                batch = next(batches)
            except StopIteration:
                return
            if dog is not None:
                dog.progress()
            yield batch
