"""``TrainerCheckpointer``: a Hugging Face ``Trainer``'s checkpoints through the incremental store.

The Trainer keeps its loop, its cadence (``save_strategy``, ``save_steps``), its data skipping on
resume and its ``checkpoint-N`` folders; only what those folders would hold changes. At each of
the Trainer's saves (``Trainer._save_checkpoint``, hooked through
:mod:`accelerate_incremental.trainer.hf_compat`):

1. The Trainer runs its own ``_save_checkpoint`` with its four writers replaced: the folder gets
   a marker (:mod:`~._trainer_markers`) instead of the weights, optimizer, scheduler, scaler and
   random states; the Trainer still picks the best checkpoint, updates its stateful callbacks,
   writes ``trainer_state.json`` and rotates ``save_total_limit`` folders.
2. Every process's random state is gathered; the main process snapshots the model (unwrapped
   state dict), the optimizer, the scheduler, the scaler, the Trainer state and the random
   states, and the store encodes and commits them in the background while training goes on.

The store is the source of truth. A marker is written before its save commits; a resume checks
that its step committed (auto-resume only ever picks committed steps). Store data is deleted
when ``save_total_limit`` is set, for the steps whose folders the Trainer's rotation removed,
only while no save is in flight (the engine never deletes an object a kept checkpoint needs);
and when a run resumed from an older checkpoint first saves, for the abandoned run's newer steps,
together with their folders (steps only increase in a store). A second save request for the
step just saved (the Trainer's JIT checkpoint right after a ``save_steps`` save) is a no-op that
waits for the first.

Resuming from a marker folder restores everything from the store, bit-exact and verified, at
the points where the Trainer restores its own files: the weights together with the optimizer
(after ``accelerator.prepare``), the random state where the Trainer restores it (after the batches
of a mid-epoch resume were skipped). A folder the Trainer wrote itself still loads its way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from accelerate_incremental import _fork
from accelerate_incremental._memory import options as memory_options
from accelerate_incremental.trainer import files, markers
from accelerate_incremental.trainer import hf_compat as _hf_compat
from accelerate_incremental.trainer import memory as memory_tier
from accelerate_incremental.trainer.loading import ABSENT as _ABSENT
from accelerate_incremental.trainer.loading import TrainerLoading, announce
from accelerate_incremental.trainer.preemption import TrainerPreemption
from lightning_incremental.core import CheckpointStore, ConfigError, SaveHandle
from lightning_incremental.core.commit import fencing
from lightning_incremental.runtime.cluster import collectives, writing
from lightning_incremental.runtime.cluster.coordinate import coordinated
from lightning_incremental.runtime.memory import steps as memory_steps
from lightning_incremental.runtime.policy.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    share_report,
)
from lightning_incremental.runtime.policy.preemption import PreemptionConfig
from lightning_incremental.runtime.state import rng

log = logging.getLogger("lightning_incremental")
FORMAT = memory_tier.FORMAT
_OWNED: weakref.WeakSet[Any] = weakref.WeakSet()  # accelerators a Trainer created


def own_accelerator(accelerator: Any) -> None:
    """Record ``accelerator`` as a Trainer's: the launch flag's generic takeover leaves it alone
    (the Trainer skips batches and saves its own way)."""
    _OWNED.add(accelerator)


def owned_by_trainer(accelerator: Any) -> bool:
    """Whether a Trainer seen by the integration created ``accelerator``."""
    return accelerator in _OWNED


class TrainerCheckpointer(TrainerLoading):
    """Routes one ``transformers.Trainer``'s checkpoints through an incremental store; created
    by :func:`accelerate_incremental.enable_trainer` (or the launch flag) on every process.

    Args:
        trainer: the Trainer, after its ``__init__``.
        dirpath: the store: a local directory or any fsspec URL.
        auto_resume: ``train()`` without ``resume_from_checkpoint`` resumes from the newest
            committed checkpoint of the store (``resume_from_checkpoint=False``: start afresh).
        preemption: what a preemption notice does while ``train()`` runs (True: the
            defaults of :class:`~lightning_incremental.runtime.policy.preemption.PreemptionConfig`;
            False: nothing): at SIGTERM (SIGINT, SLURM's requeue signal), every process saves
            the step all reach next and exits 143 once it committed (:mod:`~._trainer_preemption`).
        materialize: ``"last"``, ``"best"`` or True (both): when ``train()`` ends, those
            folders also get the model's weights as ``save_pretrained`` writes them, from the
            store, so ``from_pretrained(folder)`` loads them (:mod:`~._trainer_files`).
        memory_every_n_steps, memory_replicas, memory_dir: the memory tier
            (:mod:`~._trainer_memory`; off by default): every ``memory_every_n_steps``
            optimizer steps each process's part of the checkpoint goes to node-local memory and
            ``memory_replicas`` other nodes, and ``train()`` resumes from it when it is at least
            as new as the store's newest (``resumed_tier``: ``"memory"``, ``"peer"`` or
            ``"store"``).
        storage_options, optimizer_state, max_consecutive_failures, fork_from,
            fork_weights_only, **options: as for
            :class:`~accelerate_incremental.IncrementalCheckpointer` (with ``fork_weights_only``
            a ``train()`` that resumes no checkpoint starts from the forked step's weights).

    Attributes:
        resumed_from: the step the last ``train()`` resumed from (None: it started afresh, or
            from a folder the Trainer wrote itself).
        resumed_tier: where that step came from: ``"memory"`` (this node's memory), ``"peer"``
            (some process's part from another node) or ``"store"``.

    Raises:
        ConfigError: a bad ``materialize``, memory or store option.
    Raises (from ``train()``, before it resumes or trains: it checks that it can write the store,
    :mod:`lightning_incremental.runtime.cluster.writing`; ``evaluate`` and ``predict`` only read):
        WriterLeaseError: another job writes the store (naming its host, pid and job).
        StoreNotWritableError: the store cannot be written.
    """

    def __init__(
        self,
        trainer: Any,
        dirpath: str,
        *,
        auto_resume: bool = True,
        storage_options: dict[str, Any] | None = None,
        optimizer_state: str = "exact",
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        preemption: PreemptionConfig | bool = True,
        materialize: Any = False,
        fork_from: str | None = None,
        fork_weights_only: bool = False,
        memory_every_n_steps: int | None = None,
        memory_replicas: int = 1,
        memory_dir: Any = None,
        **options: Any,
    ) -> None:
        self.trainer = trainer
        self.auto_resume = auto_resume
        memory_opts = memory_options(memory_every_n_steps, memory_replicas, memory_dir)
        self.materialize = files.materialize_option(materialize)
        if self.materialize and _hf_compat.pretrained_model(trainer) is None:
            raise ConfigError(
                "materialize writes weights for from_pretrained, but the Trainer's model is not a "
                "transformers PreTrainedModel (or carries adapters): leave materialize off and "
                "use `lightning-incremental export STORE STEP --format hf` or trainer.save_model()"
            )
        is_main = trainer.is_world_process_zero()
        self._fork = _fork.before_open(
            is_main, dirpath, fork_from, storage_options, fork_weights_only
        )
        self.store = CheckpointStore(
            dirpath, storage_options=storage_options, optimizer_state=optimizer_state, **options
        )
        self.url = str(self.store.url)
        self._failures = FailurePolicy("Trainer checkpoints", self.url, max_consecutive_failures)
        self._handles: list[SaveHandle] = []  # the main process's saves not collected yet
        self._processes: list[Any] | None = None  # the random states of the resumed checkpoint
        self._newest_step: int | None = None  # the newest step in the store (main process)
        self._last_saved: int | None = None  # the step this train() saved last (every process)
        self.resumed_from: int | None = None
        self.resumed_tier: str | None = None
        self.generation: int | None = None
        if fencing.should_claim(trainer.args.world_size):  # also takes the lease, probes
            self.generation = writing.begin_everywhere(
                self.store, claim=True, is_coordinator=trainer.is_world_process_zero()
            )
        own_accelerator(trainer.accelerator)
        hooks: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            "train": self._train,
            "_save_checkpoint": self._save_checkpoint,
            "_load_from_checkpoint": self._load_from_checkpoint,
            "_load_optimizer_and_scheduler": self._load_optimizer_and_scheduler,
            "_load_scaler": self._load_scaler,
            "_load_rng_state": self._load_rng_state,
            "_load_best_model": self._load_best_model,
        }
        self.memory = self._memory_tier(memory_opts)
        if self.memory is not None:
            hooks[memory_tier.HOOK] = self._maybe_log_save_evaluate
            _hf_compat.add_epoch_end_callback(trainer, self.memory.epoch_ended)
        for name, make in hooks.items():
            _hf_compat.hook(trainer, name, make)
        self.preemption = TrainerPreemption(trainer, preemption)

    def _memory_tier(self, opts: Any) -> memory_tier.TrainerMemory | None:
        """The memory tier asked for, or None (off, or this release's Trainer cannot take
        steps: warned)."""
        if not opts.enabled:
            return None
        problem = memory_tier.hook_problem(self.trainer)
        if problem is None:
            return memory_tier.TrainerMemory(opts)
        memory_tier.warn(
            self.trainer,
            f"accelerate_incremental: the memory tier is off for this Trainer ({problem}); "
            "its checkpoints go to the store only",
        )
        return None

    # ------------------------------------------------------------------ train

    def _train(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            own_accelerator(self.trainer.accelerator)
            self._last_saved = None
            self.resumed_from = self.resumed_tier = None
            writing.begin_everywhere(  # before it resumes or trains: the lease, a probe
                self.store, claim=False, is_coordinator=self.trainer.is_world_process_zero()
            )
            self.preemption.start()
            try:
                if self.memory is not None:
                    self.memory.start(
                        self.trainer, self.url, self.generation, self.store.config.allow_pickle
                    )
                point = self.resume_point(resume_from_checkpoint)
                if point is None and self._fork is not None:  # a fork of weights only
                    model = self.trainer.accelerator.unwrap_model(self.trainer.model)
                    model.load_state_dict(self._fork.load("model"))
                result = own(point, *args, **kwargs)
                self.wait()
            except BaseException:
                self.preemption.stop()
                if self.memory is not None:
                    self.memory.end(None)
                raise
            if self.memory is not None:  # every process at once: the main one lists the store
                self.memory.end(self._newest_persistent)
            self.preemption.at_train_end()  # exits 143 after a preemption
            if self.materialize:  # every process gets the main one's result or its error
                written = coordinated(
                    lambda: files.materialize(self.trainer, self.store, self.materialize),
                    what=f"write the model's weights of {self.materialize} checkpoints",
                    is_coordinator=self.trainer.is_world_process_zero(),
                )
                for folder in written:
                    announce(self.trainer, f"wrote the model's weights into {folder}")
            return result

        return train

    def resume_point(self, asked: Any) -> Any:
        """What ``train`` resumes from, given the user's ``resume_from_checkpoint``: ``False``
        nothing; ``None`` the newest committed checkpoint when ``auto_resume`` (else nothing);
        ``True`` the Trainer's last ``checkpoint-N``, or the newest committed one when that
        folder's save never committed; a path, itself. With the memory tier, ``None`` and
        ``True`` resume from its agreed step instead when it is at least as new as the store's
        newest (every process together)."""
        if asked is False:
            return None
        if asked is None and not self.auto_resume:
            return None
        if asked is not None and asked is not True:
            return asked
        main = self.trainer.is_world_process_zero()
        if self.memory is not None:
            found = self._memory_resume()
            if found is not None:
                return found
        chosen = coordinated(
            lambda: self._newest(asked is True),
            what=f"choose the checkpoint to resume from in {self.url}",
            is_coordinator=main,
        )
        if chosen is None:
            return asked
        line = (
            f"RESUMING the Trainer from {chosen} (step {markers.read(chosen).step} of "  # type: ignore[union-attr]
            f"{self.url}, its newest committed checkpoint), NOT starting afresh; pass "
            "train(resume_from_checkpoint=False) to start afresh"
        )
        if self.trainer.is_world_process_zero():
            rule = "=" * 78
            log.warning("%s\naccelerate_incremental: %s\n%s", rule, line, rule)
            if asked is None:  # by itself: a notebook shows warnings where it hides logs
                warnings.warn(f"accelerate_incremental: {line}", UserWarning, stacklevel=3)
        return chosen

    def _committed(self) -> list[int]:
        """Every process together: the store's committed steps (the main process lists them,
        once for the job)."""
        steps: list[int] = coordinated(
            self.store.steps,
            what=f"list the checkpoints in {self.url}",
            is_coordinator=self.trainer.is_world_process_zero(),
        )
        return steps

    def _newest_persistent(self) -> int | None:
        """Every process together: the store's newest committed step."""
        return max(self._committed(), default=None)

    def _memory_resume(self) -> str | None:
        """Every process together: the folder of the memory tier's agreed step (see
        :mod:`~._trainer_memory`), or None to resume from the store."""
        assert self.memory is not None
        committed = self._committed()

        def uncommitted_best(folder: Any) -> int | None:
            with contextlib.suppress(ValueError, OSError):  # not a marker: the Trainer's
                found = markers.read(folder)
                if found is not None and found.store == self.url and found.step not in committed:
                    return found.step
            return None

        found = self.memory.resume(self.trainer, committed, uncommitted_best)
        if found is None:
            return None
        announce(
            self.trainer,
            f"RESUMING the Trainer from step {found.step} of the memory tier "
            f"({memory_steps.how(found.tier)}), NOT starting afresh; tier={found.tier}",
        )
        return found.folder

    def _newest(self, last_folder: bool) -> str | None:
        """On the main process: the folder of the newest committed checkpoint (rewritten from
        the store when its folder is gone); with ``last_folder``, the Trainer's last folder
        instead when it is not a marker or its step committed. None: nothing to resume."""
        run_dir = _hf_compat.run_dir(self.trainer)
        committed = self.store.steps()
        if last_folder and os.path.isdir(run_dir):
            last = _hf_compat.last_checkpoint(run_dir)
            marker = markers.read(last) if last is not None else None
            if last is not None and (marker is None or marker.step in committed):
                return last
            if last is not None:
                log.warning(
                    "accelerate_incremental: %s records step %s, which is not in %s: %s; "
                    "resuming from the newest committed one instead",
                    last,
                    marker.step if marker else None,
                    self.url,
                    _ABSENT,
                )
        if not committed:
            return None
        step = committed[-1]
        folder = markers.folder_of(run_dir, _hf_compat.checkpoint_prefix(), step)
        found = markers.read(folder)
        if found is None or found.store != self.url or found.step != step:
            saved = self.store.load(step, keys="trainer_state")["trainer_state"]
            os.makedirs(folder, exist_ok=True)
            files.write_folder(self.trainer, folder, self.url, step)
            with open(os.path.join(folder, _hf_compat.state_file()), "w", encoding="utf-8") as fh:
                fh.write(saved)
        return folder

    # ------------------------------------------------------------------ saving

    def _save_checkpoint(self, own: Callable[..., Any]) -> Callable[..., Any]:
        trainer = self.trainer
        warned: list[bool] = []

        def _save_checkpoint(model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
            if trial is not None:  # a hyper-parameter search trial: the Trainer's own folders
                if not warned:
                    warned.append(True)
                    announce(trainer, "hyper-parameter search trials save full checkpoints")
                return own(model, trial, *args, **kwargs)
            step = trainer.state.global_step
            if step == self._last_saved:
                # asked again for the step just saved (the Trainer's JIT checkpoint right after
                # a save_steps save): the same state, so the first save stands; wait for it
                if trainer.is_world_process_zero():
                    self._failures.collect(self._handles, block=True)
                return None
            real_save_model = trainer.save_model

            def save_model(output_dir: Any = None, _internal_call: bool = False) -> None:
                if not _internal_call:
                    real_save_model(output_dir, _internal_call)
                    return
                if trainer.args.push_to_hub:  # the upload needs the weights as files
                    real_save_model(output_dir, _internal_call)
                if trainer.args.should_save:
                    files.write_folder(trainer, output_dir, self.url, step)

            def nothing(output_dir: Any) -> None:
                os.makedirs(output_dir, exist_ok=True)

            writers = dict.fromkeys(_hf_compat.WRITERS, nothing)
            writers["save_model"] = save_model
            with _hf_compat.writers_replaced(trainer, writers):
                own(model, trial, *args, **kwargs)
            folder = markers.folder_of(
                _hf_compat.run_dir(trainer), _hf_compat.checkpoint_prefix(), step
            )
            self.save(step, folder)
            self._last_saved = step
            return None

        return _save_checkpoint

    def save(self, step: int, folder: str) -> SaveHandle | None:
        """Save the Trainer's whole training state as checkpoint ``step``, with the
        ``trainer_state.json`` the Trainer just wrote to ``folder`` (every process calls it: the
        random states are gathered). Returns the main process's save handle."""
        trainer = self.trainer
        processes = collectives.gather_to(rng.capture())  # on the main process, which saves
        self._settle(block=False)
        if not trainer.is_world_process_zero():
            return None
        if not self._handles:
            self._sweep()
        self._replace_newer(step)
        with open(os.path.join(folder, _hf_compat.state_file()), encoding="utf-8") as fh:
            trainer_state = fh.read()
        state = memory_tier.training_state(trainer, trainer_state, processes)
        metadata = {"global_step": step, "epoch": trainer.state.epoch}
        handle = self._failures.start(
            lambda: self.store.save(state, step, metadata=metadata, world_size=len(processes)),
            lambda: self._failures.collect(self._handles, block=False),
        )
        if handle is not None:
            self._handles.append(handle)
            self._newest_step = step
        return handle

    def _replace_newer(self, step: int) -> None:
        """A run resumed from an older checkpoint reaches a step the store already holds (or
        one below a step it holds): steps only increase in a store, so at this first save the
        store's checkpoints from ``step`` on, those of the abandoned run, are deleted, and with
        them their ``checkpoint-N`` folders (which would name deleted steps), with a warning."""
        if self._newest_step is None:
            self._newest_step = max(self.store.steps(), default=-1)
        if step > self._newest_step:
            return
        newer = [s for s in self.store.steps() if s >= step]
        run_dir = _hf_compat.run_dir(self.trainer)
        prefix = _hf_compat.checkpoint_prefix()
        folders = []
        for old in newer[1:] if newer and newer[0] == step else newer:  # step's: just written
            folder = markers.folder_of(run_dir, prefix, old)
            with contextlib.suppress(ValueError):  # an unreadable record: not ours to remove
                found = markers.read(folder)
                if found is not None and found.store == self.url and found.step == old:
                    folders.append(folder)
        log.warning(
            "accelerate_incremental: saving step %s of a run resumed from an older checkpoint: "
            "deleting the abandoned run's newer checkpoints %s from %s and their folders %s "
            "(steps only increase in a store)",
            step,
            newer,
            self.url,
            [os.path.basename(f) for f in folders],
        )
        for folder in folders:  # first: a folder never names a deleted step
            shutil.rmtree(folder)
        for old in reversed(newer):
            self.store.delete(old)

    def _settle(self, *, block: bool) -> None:
        """Collect finished saves (all with ``block``); warn about failed ones, or raise at
        ``max_consecutive_failures`` (every process alike: a collective)."""
        report = None
        if self.trainer.is_world_process_zero():
            self._failures.collect(self._handles, block=block)
            report = self._failures.report()
        self._failures.apply(share_report(report))

    def _sweep(self) -> None:
        """With ``save_total_limit``: delete the store's checkpoints whose folders the Trainer's
        rotation removed (main process, no save in flight)."""
        if not self.trainer.args.save_total_limit:
            return
        kept = markers.steps_with_folders(_hf_compat.run_dir(self.trainer), self.url)
        for step in self.store.steps():
            if step not in kept:
                self.store.delete(step)

    def wait(self) -> None:
        """Wait for every save to commit (failed ones warned about), then apply the retention;
        every process calls it."""
        self._settle(block=True)
        if self.trainer.is_world_process_zero():
            self.store.wait()
            self._sweep()
        if self.memory is not None:
            self.memory.wait()

    def _maybe_log_save_evaluate(self, own: Callable[..., Any]) -> Callable[..., Any]:
        def _maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> Any:
            result = own(*args, **kwargs)
            trial = args[3] if len(args) > 3 else kwargs.get("trial")
            assert self.memory is not None
            self.memory.after_log_save_evaluate(self.trainer, trial)
            return result

        return _maybe_log_save_evaluate

    def close(self) -> None:
        """Wait for pending saves and release the store."""
        self.store.close()
