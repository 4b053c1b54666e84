"""The checkpointer's preemption path, over :mod:`lightning_incremental.runtime.policy.preemption`.

A SIGTERM or SIGINT (SLURM's requeue signal under SLURM), delivered any number of times, or
:meth:`~accelerate_incremental.IncrementalCheckpointer.request_preemption`, only records a
request (Accelerate installs no handler of its own in the training processes: see
:mod:`~._compat`). The batch boundary is a tracked epoch about to hand out its next batch
(also its first): a batch of :meth:`~accelerate_incremental.IncrementalCheckpointer.iterate`,
or of a plain ``for`` loop over a prepared DataLoader after ``take_over`` (the launch flag).
There every process agrees
— one all-reduce of a flag with more than one process: every process fetches the same number of
batches, so every one enters it as often — and once any process was asked, each saves that step
and waits for its commit, then exits with code 143 (``SystemExit`` out of the script's loop).

What is saved:

* the script passed steps to ``maybe_save()`` / ``save()``: the newest of them, when it is newer
  than the last saved one (else the newest saved checkpoint holds this state already);
* otherwise, on an accelerator taken over (the launch flag): what ``accelerator.save_state()``
  does — checkpoint ``project_configuration.iteration``, the save pre-hooks, then the iteration
  incremented.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from accelerate_incremental import _takeover
from lightning_incremental.core import SaveHandle
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.policy.preemption import Preemption, PreemptionConfig

log = logging.getLogger("lightning_incremental")


class PreemptionPoint:
    """One checkpointer's preemption state: the request, the steps, the boundary.

    Args:
        accelerator: the checkpointer's accelerator.
        preemption: what to handle and how (a bool: the defaults, on or off); the signals are
            handled from construction (main thread only: elsewhere it logs, and
            :meth:`request` remains) until :meth:`stop`.
    """

    def __init__(self, accelerator: Any, preemption: PreemptionConfig | bool) -> None:
        self.accelerator = accelerator
        self.config = config = PreemptionConfig.of(preemption)
        self.state = Preemption(config)
        self.newest: int | None = None  # the newest step the script passed to maybe_save/save
        self.saved: int | None = None  # the newest step a save was started for
        if config.enabled:
            self.state.install()

    def stop(self) -> None:
        self.state.uninstall()

    def request(self, reason: str) -> None:
        self.state.request(reason)

    def seen(self, step: int) -> None:
        """The script passed ``step`` to ``maybe_save()`` / ``save()`` (checked there)."""
        if isinstance(step, int) and not isinstance(step, bool):
            self.newest = step if self.newest is None else max(self.newest, step)

    def committed(self, handles: Sequence[SaveHandle]) -> None:
        """These saves committed: learn how long saves take (warned once above the grace)."""
        for handle in handles:
            self.state.observe_save(handle.wait().total_s)

    def at_boundary(self, owner: Any, save_and_wait: Callable[[int | None], None]) -> None:
        """At a batch boundary, on every process: when any process was asked, save this step,
        wait for its commit and exit (``SystemExit``). ``owner``: the checkpointer;
        ``save_and_wait(step)`` saves ``step`` (None: nothing new) and waits for every pending
        save's commit."""
        if not self.config.enabled or self.state.agreed:
            return
        acc = self.accelerator
        if acc.num_processes > 1:
            device = acc.device
            agreed = self.state.agree(lambda flag: collectives.any_true(flag, device=device))
        else:
            agreed = self.state.agree()
        if not agreed:
            return
        if self.newest is not None:
            fresh = self.saved is None or self.newest > self.saved
            if not fresh:
                log.warning(
                    "preemption: step %d is saved already, nothing new to save (pass every "
                    "step to maybe_save() for a preemption to save the newest one)",
                    self.newest,
                )
            save_and_wait(self.newest if fresh else None)
            committed = f"step {self.newest if fresh else self.saved}"
        elif _takeover.installed(acc) is owner:
            iteration = acc.project_configuration.iteration
            acc.save_state()  # the taken-over save_state: saves, waits, increments
            committed = f"checkpoint {iteration} (accelerator.save_state)"
        else:
            log.warning(
                "preemption: no step to save (maybe_save()/save() never called and "
                "accelerator.save_state() not taken over)"
            )
            save_and_wait(None)
            committed = "every pending save"
        self.state.finish(
            rank=acc.process_index,
            requeue_default=bool(os.environ.get("SLURM_JOB_ID")),
            committed=committed,
        )
