"""The read-only views of :class:`~.callback.IncrementalCheckpoint`: its schedule, the store
it resolved, what this ``fit`` claimed, resumed from and saved."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from lightning_incremental.core import SaveResult
from lightning_incremental.runtime.policy.cadence import Cadence

if TYPE_CHECKING:
    from lightning_incremental.lightning.fit_state import FitState
    from lightning_incremental.lightning.schedule import Schedule


class Views:
    """Properties over the callback's ``schedule``, ``_fit`` and ``_last_saved_step``."""

    schedule: Schedule
    _fit: FitState
    _last_saved_step: int | None

    @property
    def every_n_train_steps(self) -> int:
        return self.schedule.every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        return self.schedule.every_n_epochs

    @property
    def train_time_interval(self) -> timedelta | None:
        return self.schedule.train_time_interval

    @property
    def cadence(self) -> Cadence | None:
        """This ``fit``'s adaptive interval (``max_overhead``/``expected_mtbf``): its choices."""
        return self._fit.points.cadence

    @property
    def url(self) -> str | None:
        """The store's location, resolved when ``fit`` starts."""
        return self._fit.url

    @property
    def last_saved_step(self) -> int | None:
        """The newest step saved (or being saved) by this callback, restored on resume."""
        return self._last_saved_step

    @property
    def generation(self) -> int | None:
        """The fencing generation this ``fit`` claimed (multi-process runs), else None."""
        return self._fit.generation

    @property
    def resumed_from(self) -> int | None:
        """The step this ``fit`` resumed from automatically, or None."""
        return self._fit.resumed_step

    @property
    def resumed_tier(self) -> str | None:
        """Where :attr:`resumed_from` came from: ``"memory"``, ``"peer"`` or ``"store"``."""
        return self._fit.resumed_tier

    @property
    def results(self) -> list[tuple[SaveResult, float]]:
        """This ``fit``'s committed saves (rank 0; sharded: every rank's part), each engine
        :class:`~lightning_incremental.core.SaveResult` with the seconds training was blocked."""
        saver = self._fit.saver
        return list(saver.results) if saver is not None else []
