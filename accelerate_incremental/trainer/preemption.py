"""A Hugging Face ``Trainer``'s preemption path (the mechanism: ``runtime.preemption``).

While ``train()`` runs, a SIGTERM or SIGINT (SLURM's requeue signal under SLURM), any number of
times, only records a request. At the end of every optimizer step (the Trainer's ``on_step_end``,
on every process) the processes agree — one all-reduce of a flag with more than one process — and
once any was asked, each makes the Trainer save that step and stop: the save is the Trainer's own
``_save_checkpoint`` at the point of the loop where it saves at its cadence, so through the
store, and a resume from it is exact. ``train()`` then waits for the commit, rank 0 requeues the
job under SLURM, and every process exits with code 143 (``SystemExit``). A request that comes
after the last step counts when ``train()`` ends: every save committed, the processes exit 143.

The Trainer's JIT checkpoint (``TrainingArguments(enable_jit_checkpoint=True)``) is its own answer
to SIGTERM; this path takes its place (:func:`~.hf_compat.stand_aside_jit_checkpoint`): one
process saving on its own when its timer fires would leave the others waiting in a collective.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from accelerate_incremental.trainer import hf_compat as _hf_compat
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.policy.preemption import Preemption, PreemptionConfig

log = logging.getLogger("lightning_incremental")


class TrainerPreemption:
    """One Trainer's preemption state: the request, the agreement, the exit.

    Args:
        trainer: the Trainer (after its ``__init__``).
        preemption: what to handle and how (a bool: the defaults, on or off).
    """

    def __init__(self, trainer: Any, preemption: PreemptionConfig | bool) -> None:
        self.trainer = trainer
        self.config = PreemptionConfig.of(preemption)
        self.state = Preemption(self.config)
        self.step: int | None = None  # the step saved for the preemption
        if self.config.enabled:
            if _hf_compat.stand_aside_jit_checkpoint(trainer):
                log.warning(
                    "accelerate_incremental: enable_jit_checkpoint is replaced by the "
                    "incremental preemption path (a SIGTERM saves the step every process "
                    "reaches next, then the processes exit 143)"
                )
            _hf_compat.add_step_end_callback(trainer, self.at_step_end)

    def start(self) -> None:
        """``train()`` starts: handle the signals (main thread only)."""
        if self.config.enabled:
            self.state = Preemption(self.config)
            self.step = None
            self.state.install()

    def at_step_end(self, control: Any) -> None:
        """After each optimizer step, on every process: when any process was asked, make the
        Trainer save this step and stop."""
        if not self.config.enabled or self.state.agreed:
            return
        if not self._agree():
            return
        self.step = self.trainer.state.global_step
        control.should_save = True
        control.should_training_stop = True

    def _agree(self) -> bool:
        if self.trainer.args.world_size > 1:
            device = self.trainer.accelerator.device
            return self.state.agree(lambda flag: collectives.any_true(flag, device=device))
        return self.state.agree()

    def at_train_end(self) -> None:
        """``train()`` returned and every save committed: exit with the configured code when
        the processes stopped for a preemption, or when one was asked after the last step (every
        process calls it: a collective). Otherwise stop handling the signals."""
        if not self.config.enabled:
            return
        if not self.state.agreed:
            self._agree()
        if not self.state.agreed:
            self.state.uninstall()
            return
        step = self.step if self.step is not None else self.trainer.state.global_step
        self.state.finish(
            rank=self.trainer.args.process_index,
            requeue_default=bool(os.environ.get("SLURM_JOB_ID")),
            committed=f"step {step}",
        )

    def stop(self) -> None:
        """``train()`` ended another way (an error): stop handling the signals."""
        self.state.uninstall()
