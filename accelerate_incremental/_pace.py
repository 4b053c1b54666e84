"""The adaptive interval of :meth:`IncrementalCheckpointer.maybe_save
<accelerate_incremental.IncrementalCheckpointer.maybe_save>`: ``max_overhead`` (the fraction of
training time checkpointing may cost) and/or ``expected_mtbf`` (Young/Daly's interval), measured
as training sees a save (:mod:`lightning_incremental.runtime.policy.cadence`).

Each ``maybe_save(step)`` call ends a step: its time since the previous call is a measurement,
with whether a save of the main process was still in flight. The main process decides whether a
save is due and every process gets its decision (one small broadcast per step when there are
several processes), so every process saves at the same steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_incremental.core import SaveHandle
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.policy.cadence import Cadence, CadenceConfig

log = logging.getLogger("accelerate_incremental")


class Pace:
    """:class:`~lightning_incremental.runtime.policy.cadence.Cadence` over ``maybe_save`` calls."""

    def __init__(self, config: CadenceConfig, *, is_main: bool, processes: int) -> None:
        self.cadence = Cadence(config)
        self.is_main = is_main
        self.processes = processes

    @classmethod
    def of(
        cls,
        max_overhead: float | None,
        expected_mtbf: float | None,
        every_n_steps: int | None,
        accelerator: Any,
    ) -> Pace | None:
        if max_overhead is None and expected_mtbf is None:
            return None
        config = CadenceConfig(
            max_overhead=max_overhead,
            expected_mtbf=expected_mtbf,
            min_interval=every_n_steps or 1,
        )
        return cls(config, is_main=accelerator.is_main_process, processes=accelerator.num_processes)

    def due(self, step: int, handles: list[SaveHandle]) -> bool:
        """After the step that reached ``step``: whether to save now (the main process's
        decision, on every process)."""
        cadence = self.cadence
        before = cadence.interval if cadence.choices else None
        cadence.step_ended(step, time.monotonic(), in_flight=self.in_flight(handles))
        if cadence.choices and cadence.interval != before and self.is_main:
            log.info("IncrementalCheckpointer: %s", cadence.choices[-1].describe(cadence.config))
        due = cadence.due(step)
        if self.processes > 1 and collectives.is_distributed():
            due = collectives.broadcast(due, src=0)
        return due

    @staticmethod
    def in_flight(handles: list[SaveHandle]) -> bool:
        """A save of this process is still running in the background."""
        return any(not handle.done() for handle in handles)

    def saved(self, step: int, started: float) -> None:
        """A save of ``step`` (any: scheduled, explicit, ``save_state``) began at ``started``
        (``time.monotonic()``) and returned now."""
        self.cadence.saved(step, time.monotonic() - started)


def log_report(pace: Pace) -> None:
    """Log what checkpointing cost (at ``close``), once it was measured."""
    cadence = pace.cadence
    achieved = cadence.achieved()
    if achieved is not None:
        log.info(
            "IncrementalCheckpointer: checkpointing cost %.2f%% of training time (%s; intervals "
            "chosen: %s)",
            100 * achieved,
            cadence.config.describe(),
            [c.interval for c in cadence.choices],
        )
