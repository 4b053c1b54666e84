"""The memory tier under a Hugging Face ``Trainer`` (:class:`~._trainer.TrainerCheckpointer`
with ``memory_every_n_steps``): every so many optimizer steps each process puts its part of the
checkpoint — what the store's checkpoint of that step would hold — into node-local memory and,
in the background, onto ``memory_replicas`` other nodes; ``train()`` resumes from the newest step
every process agrees on when it is at least the store's newest (the framework-free part:
:mod:`lightning_incremental.runtime.memory.steps`).

Where a step is taken: right after ``Trainer._maybe_log_save_evaluate`` of that step returns,
the point where the Trainer's own checkpoint of the step is written (inside that call), so the
step's logging, evaluation, best-metric bookkeeping and store save are already done and the
next step's batches not drawn yet: the ``trainer_state.json`` and random states a memory step
holds are those a checkpoint of the step would hold. At the last step of an epoch the Trainer
runs ``on_epoch_end`` and that call once more (epoch-strategy logging, evaluation, saving), so
the step is taken after the second call. ``on_step_end`` would be too early (the step's
logging and evaluation come after it, and a log of the step would be missing from the resumed
``log_history``); the next ``on_step_begin`` too late (the next step's batches, and the random
numbers a data collator draws for them, are already taken).

A resume from memory hands the Trainer a private folder holding only the step's
``trainer_state.json``, so that the Trainer's own resume (its step counters, the skipped
batches of a mid-epoch resume, its callbacks' state) runs as for any checkpoint; the load
points the integration hooks restore the weights, optimizer, scheduler, scaler and this
process's random state from the memory part instead of the store. The folder is deleted when
``train()`` ends.

Under DDP only each node's first process takes the weights and optimizer (one copy a node, as
:mod:`~lightning_incremental.runtime.memory.steps` explains); every process takes its random
state. The Trainer's checkpoints keep no per-process buffers (``ddp_broadcast_buffers=False`` is
warned about at a resume either way).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelerate_incremental.trainer import hf_compat as _hf_compat
from lightning_incremental.core.commit.owner import process_exists
from lightning_incremental.runtime.memory.steps import MemoryOptions, MemorySteps
from lightning_incremental.runtime.state import rng

log = logging.getLogger("lightning_incremental")
FORMAT = "accelerate_incremental.trainer/1"  # the Trainer's checkpoints, in the store and memory
OWNER = "accelerate_incremental (Trainer)"
#: The Trainer method after which a step is taken (see the notes).
(HOOK,) = _hf_compat.MEMORY_HOOKED


def warn(trainer: Any, message: str) -> None:
    """On the main process: ``message`` logged and warned (a notebook shows warnings where it
    hides logs)."""
    if trainer.is_world_process_zero():
        log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def training_state(trainer: Any, trainer_state: str, processes: list[Any]) -> dict[str, Any]:
    """What a Trainer checkpoint holds: the unwrapped model's state dict, the optimizer,
    scheduler and scaler, ``trainer_state.json`` as text and the processes' random states."""
    scaler = trainer.accelerator.scaler
    scheduler = trainer.lr_scheduler
    return {
        "format": FORMAT,
        "model": trainer.accelerator.unwrap_model(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "trainer_state": trainer_state,
        "processes": processes,
    }


def apply_state(trainer: Any, state: dict[str, Any]) -> None:
    """Put a checkpoint's model, optimizer, scheduler and scaler into the Trainer (after
    ``accelerator.prepare``)."""
    trainer.accelerator.unwrap_model(trainer.model).load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.lr_scheduler is not None and state["scheduler"] is not None:
        trainer.lr_scheduler.load_state_dict(state["scheduler"])
    scaler = trainer.accelerator.scaler
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])


def trainer_state_now(trainer: Any) -> str:
    """The ``trainer_state.json`` the Trainer's ``_save_checkpoint`` would write now (call
    :meth:`~transformers.Trainer.store_flos` first, as it does): the state of its
    ``ExportableState`` callbacks and of its ``TrainerControl`` recorded, as JSON text that
    ``TrainerState.load_from_json`` reads. The Trainer's state is left as it is.

    Cost: one pass of the C JSON encoder over the state, about 1.3 µs per ``log_history``
    entry (13 ms at 10,000 entries, against 110 ms for ``save_to_json``'s indented text of a
    deep copy), on the training thread of each node's first process at every memory step."""
    from transformers.trainer_callback import ExportableState

    state = trainer.state
    record = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    stateful = dict(record.get("stateful_callbacks") or {})  # the Trainer's own stays as it is
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if isinstance(stateful.get(name), list):
                stateful[name] = [*stateful[name], cb.state()]
            else:
                stateful[name] = cb.state()
    record["stateful_callbacks"] = stateful
    return json.dumps(record)


def hook_problem(trainer: Any) -> str | None:
    """Why the memory tier cannot take steps in this ``transformers`` release (None: it can)."""
    found = _hf_compat.signature_problems(trainer, _hf_compat.MEMORY_HOOKED)
    return "; ".join(found) or None


@dataclass
class Resumed:
    """A resume from the memory tier: the folder handed to the Trainer and the step's state."""

    folder: str
    step: int
    tier: str
    state: dict[str, Any]


class TrainerMemory:
    """One Trainer's memory tier: :meth:`start` and :meth:`end` bracket each ``train()``."""

    def __init__(self, opts: MemoryOptions) -> None:
        self.opts = opts
        self.steps: MemorySteps | None = None  # while train() runs
        self.resumed: Resumed | None = None
        self._taken: int | None = None  # the newest step taken in this train()
        self._epoch_ended = False  # on_epoch_end ran since the last hooked call

    # ------------------------------------------------------------------ lifetime

    def start(self, trainer: Any, url: str, generation: int | None, allow_pickle: bool) -> None:
        """Every process at once, as ``train()`` starts: the memory tier of this run."""
        main = trainer.is_world_process_zero()
        self.steps = MemorySteps(
            self.opts,
            rank=trainer.args.process_index,
            world_size=trainer.args.world_size,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            url=url,
            generation=generation,
            allow_pickle=allow_pickle,
            owner=OWNER,
            info=lambda text: log.info(text) if main else None,
            warn=lambda text: warn(trainer, text),
            replicated=True,  # DDP or one process: FSDP and DeepSpeed are refused up front
            local_rank=trainer.args.local_process_index,
        )
        self._taken, self._epoch_ended = None, False

    def end(self, newest_persistent: Callable[[], int | None] | None) -> None:
        """As ``train()`` ends: the resume folder goes. ``newest_persistent`` (None: the run
        failed) gives the store's newest step once every save committed; when it is at least
        the last memory step, this process's parts and the replicas it keeps go too, freeing
        the node's memory; else they stay for a resume."""
        if self.resumed is not None:
            shutil.rmtree(self.resumed.folder, ignore_errors=True)
            self.resumed = None
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.end(newest_persistent)

    def wait(self) -> None:
        """Wait for this process's memory step in flight (written and replicated)."""
        if self.steps is not None:
            self.steps.wait()

    # ------------------------------------------------------------------ taking steps

    def epoch_ended(self) -> None:
        """``on_epoch_end`` ran: the next hooked call is the epoch's last."""
        self._epoch_ended = True

    def after_log_save_evaluate(self, trainer: Any, trial: Any) -> None:
        """Take the step just finished into memory when it is due (see the module's notes)."""
        ended, self._epoch_ended = self._epoch_ended, False
        steps = self.steps
        step = trainer.state.global_step
        if steps is None or trial is not None or not steps.due(step) or step == self._taken:
            return
        if not ended and _epoch_ends(trainer):
            return  # on_epoch_end and the epoch's end work come first
        trainer.store_flos()  # as _save_checkpoint does; a collective under DDP
        own = rng.capture()
        if steps.whole:
            state = training_state(trainer, trainer_state_now(trainer), [own])
            steps.take(step, {"format": FORMAT, "step": step, "state": state})
        else:  # the node's first process holds the rest (memory_steps' notes)
            steps.take(step, {"format": FORMAT, "step": step, "processes": [own]})
        self._taken = step

    # ------------------------------------------------------------------ resuming

    def resume(
        self, trainer: Any, committed: list[int], uncommitted_best: Callable[[Any], int | None]
    ) -> Resumed | None:
        """Every process together: the memory step to resume from, with a private folder
        holding its ``trainer_state.json`` for the Trainer, or None for the store
        (``committed``: the store's steps; ``uncommitted_best(path)``: the step a best
        checkpoint's folder names when that step is not in the store, else None)."""
        assert self.steps is not None
        found = self.steps.resume(max(committed, default=None), _check_step, _merge)
        if found is None:
            return None
        step, part, tier = found
        state = part["state"]
        record = json.loads(state["trainer_state"])
        best = record.get("best_model_checkpoint")
        lost = uncommitted_best(best) if best else None
        if lost is not None:
            # A store save still in flight when the memory step was taken, lost with the
            # process: the folder stays, its step does not. As the Trainer does for a best
            # folder that is gone, the path is dropped and the best metric kept; so is the best
            # step, from which the Trainer's next save would name the folder again.
            record["best_model_checkpoint"] = record["best_global_step"] = None
            warn(
                trainer,
                f"{OWNER}: memory step {step} records {best} as the best checkpoint, but its "
                f"save (step {lost}) never committed to the store: it is ignored, and "
                "load_best_model_at_end loads a later best checkpoint, if any",
            )
        sweep_resume_folders()
        folder = tempfile.mkdtemp(prefix=f"{RESUME_PREFIX}{step}-{os.getpid()}-")
        path = os.path.join(folder, _hf_compat.state_file())
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(record))
        self.resumed = Resumed(folder, step, tier, state)
        return self.resumed

    def resumed_at(self, path: Any) -> Resumed | None:
        """The memory resume whose folder ``path`` is (None: another checkpoint)."""
        found = self.resumed
        if found is None or not isinstance(path, (str, os.PathLike)):
            return None
        return found if os.path.abspath(path) == os.path.abspath(found.folder) else None


#: A memory resume's folder: this, the step, the process id, a random part.
RESUME_PREFIX = "accelerate-incremental-memory-"


def sweep_resume_folders(directory: str | None = None) -> int:
    """Remove the memory-resume folders of processes that are gone (killed before
    ``train()`` ended, which removes its own): one small folder each, left in the temporary
    directory by every preempted run otherwise. A folder whose process is alive (or may be:
    another user's) stays, as do those named otherwise. Returns how many went."""
    directory = directory or tempfile.gettempdir()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    gone = 0
    for name in names:
        if not name.startswith(RESUME_PREFIX):
            continue
        fields = name[len(RESUME_PREFIX) :].split("-")
        if len(fields) != 3 or not fields[1].isdigit() or process_exists(int(fields[1])):
            continue
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        gone += 1
    return gone


def _epoch_ends(trainer: Any) -> bool:
    """Whether the Trainer's loop leaves the epoch after this step: its last batch, or a stop
    (``max_steps`` reached, a callback such as early stopping setting ``should_training_stop``
    or ``should_epoch_stop``). The Trainer then runs ``on_epoch_end`` and logs, evaluates and
    saves once more for the step (epoch strategies)."""
    control, epoch = trainer.control, trainer.state.epoch
    if control.should_training_stop or control.should_epoch_stop:
        return True
    return epoch is not None and float(epoch).is_integer()


def _merge(whole: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """This process's part: its node's first process's, with this process's random state."""
    whole["state"]["processes"] = own["processes"]
    return whole


def _check_step(part: Any, step: int) -> None:
    held = part.get("step") if isinstance(part, dict) else None
    if held != step or part.get("format") != FORMAT or "state" not in part:
        raise ValueError(f"the part holds step {held!r} of a Trainer checkpoint, not {step}")
    if part["state"].get("format") != FORMAT:
        raise ValueError(f"the part of step {step} is not a Trainer checkpoint")
