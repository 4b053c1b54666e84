"""The positions of one accelerator's prepared DataLoaders: which prepared loader an object is,
its :class:`~accelerate_incremental._position.LoaderPosition`, and one tracked epoch of it (the
iteration of :meth:`IncrementalCheckpointer.iterate` and of a taken-over loader's own ``for``
loop)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from accelerate_incremental import _compat, _resize, _tracking
from accelerate_incremental._position import LoaderPosition
from lightning_incremental.runtime.cluster.watchdog import Watchdog
from lightning_incremental.runtime.state import rng


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

    def restore_saved(self, processes: list[dict[str, Any]]) -> dict[str, Any]:
        """Put back the loaders' positions of a checkpoint's ``processes`` (every process's
        saved state), on this many processes or another (then the main process warns with the
        account of it, see :meth:`restore_resized`). Returns this process's saved state: that of
        process ``index mod len(processes)``.

        Raises:
            ValueError: a saved position does not fit its loader.
        """
        acc = self.accelerator
        mine: dict[str, Any] = processes[acc.process_index % len(processes)]
        if not _resize.needed(processes, acc.num_processes):
            self.restore(mine["loaders"], mine["rng"])
            return mine
        accounts = self.restore_resized(processes[0]["loaders"], mine["rng"], len(processes))
        for text in accounts if acc.is_main_process else []:
            warnings.warn(text, UserWarning, stacklevel=4)
        return mine

    def restore_resized(
        self, main: list[dict[str, Any]], saved_rng: dict[str, Any], old_world: int
    ) -> list[str]:
        """Put back the positions saved by ``old_world`` processes (``main``: the main process's,
        every process's order being the main process's) on this run's processes: an interrupted
        epoch's rest is cut anew (see :mod:`~._resize`). Returns the account of each loader
        resumed mid-epoch.

        Raises:
            ValueError: a loader's interrupted epoch cannot be cut anew (saying why).
        """
        acc = self.accelerator
        accounts = []
        for i, saved in enumerate(main):
            position = self.position(i)
            if saved.get("consumed") is None:
                position.restore_boundary(saved)
                accounts.append(
                    _resize.account(
                        old=old_world,
                        new=acc.num_processes,
                        where=f"DataLoader {i}, before epoch {saved['epoch']}",
                        resumed=None,
                        batch_size=0,
                        data_note=f"epoch {saved['epoch']} starts whole, split over the "
                        f"{acc.num_processes} process(es)",
                    )
                )
                continue
            layout = _resize.layout(position.loader)
            rest = (
                layout
                if isinstance(layout, str)
                else _resize.rest_of(position.loader, layout, saved, old_world)
            )
            if isinstance(rest, str) or isinstance(layout, str):
                raise ValueError(
                    f"prepared DataLoader {i} stood {saved['consumed']} batches into epoch "
                    f"{saved['epoch']} when {old_world} processes saved, and the rest of that "
                    f"epoch cannot be cut for {acc.num_processes}: {rest}; resume with "
                    f"--num_processes {old_world}, or save at epoch ends"
                )
            samples, done, length = rest
            plan = _resize.plan(
                layout,
                samples,
                consumed_before=int(saved["consumed"]),
                world=acc.num_processes,
                rank=acc.process_index,
                old_world=old_world,
                done_before=done,
                length=length,
            )
            cut = {
                "rest": plan.rest,
                "segment": plan.segment.to_dict(),
                "batch_size": plan.batch_size,
                "done": done,
            }
            position.restore_cut(saved, plan.batches, cut)
            where = f"DataLoader {i}, epoch {saved['epoch']}, after {saved['consumed']} batches"
            accounts.append(
                _resize.account(
                    old=old_world,
                    new=acc.num_processes,
                    where=where,
                    resumed=plan.account,
                    batch_size=plan.batch_size,
                    data_note="",
                )
            )
        self._saved_rng = saved_rng
        return accounts

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

        def open_batches(batches: list[list[int]]) -> Any:
            return _compat.loader_over(loader, _resize.FixedBatches(batches))

        def restore_now() -> None:
            if self._saved_rng is not None:
                rng.restore(self._saved_rng)

        before()
        dog = watchdog()
        batches = position.iterate(open_epoch, restore_now, open_batches)
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
