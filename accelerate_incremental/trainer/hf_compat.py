"""Every use of a Hugging Face ``transformers`` internal, in one module, read against the
``transformers`` sources of the releases we support (:data:`OLDEST_SUPPORTED` to
:data:`NEWEST_CHECKED`).

``transformers`` has no public API for what the Trainer integration must change: where a
``Trainer`` writes and reads its ``checkpoint-N`` directories. The integration replaces these
methods *on one Trainer instance* (instance attributes that shadow the class's, the class and
other Trainers untouched), each wrapping the instance's own bound method so that a subclass's
override still runs:

- ``train(resume_from_checkpoint=None, ...)``: the public entry; wrapped to choose the checkpoint
  to resume from (auto-resume) and to wait for the last save at the end.
- ``_save_checkpoint(model, trial)``: writes ``checkpoint-N`` (weights through
  ``save_model(dir, _internal_call=True)``, then ``_save_optimizer_and_scheduler(dir)``,
  ``_save_scaler(dir)``, ``_save_rng_state(dir)``, ``trainer_state.json``, the Hub push and the
  rotation of ``save_total_limit``). The integration runs it with the four writers replaced
  for the duration of the call (:func:`writers_replaced`), so the Trainer still decides the best
  checkpoint, updates the stateful callbacks, writes ``trainer_state.json`` and rotates.
- ``_load_from_checkpoint(path, model=None)``, ``_load_optimizer_and_scheduler(path)``,
  ``_load_scaler(path)``, ``_load_rng_state(path)``: the resume, in this order (the weights
  before ``accelerator.prepare``, the optimizer, scheduler and scaler after it, the random state
  once the skipped batches of a mid-epoch resume were drawn).
- ``_load_best_model()``: ``load_best_model_at_end``.
- ``_maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ...)``, with the memory
  tier only (:data:`MEMORY_HOOKED`, its parameters checked when the tier is asked for): a memory
  step is taken when it returns.

The preemption path (:mod:`~.preemption`) adds a ``TrainerCallback`` (public API) and
reads the Trainer's JIT checkpoint (``TrainingArguments(enable_jit_checkpoint=True)``, in
``transformers.trainer_jit_checkpoint``, up to 5.24 as checked): a ``JITCheckpointCallback``
among the Trainer's callbacks whose ``jit_manager`` (a ``CheckpointManager``) replaces the SIGTERM
handler in the Trainer's ``__init__`` and restores it (``_original_sigterm_handler``) at
``on_train_end``. Its handler logs and starts a ``threading.Timer`` inside the signal handler
(``kill_wait``, 3 s); when the timer fires, the next step boundary of *that* process saves a
checkpoint and stops training — on its own, while the other processes go on into their next
collective. :func:`stand_aside_jit_checkpoint` takes it out while the preemption path is armed.

All of them have had these names, parameters and roles throughout the 5.x releases up to
5.24; :func:`problems` checks the parameters of the installed release at start-up, so a release
that renamed one is refused with its name instead of failing later. Also read here:
``trainer.is_deepspeed_enabled`` / ``is_fsdp_enabled`` (public attributes set in ``__init__``),
the ``checkpoint-N`` naming (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``) and
``trainer_state.json`` (``transformers.trainer.TRAINER_STATE_NAME``).

Importing this module does not import ``transformers``: every function takes the Trainer it is
about, or imports ``transformers`` when called (only once a Trainer is in use).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

#: The oldest ``transformers`` release the integration supports (the test extra's requirement).
OLDEST_SUPPORTED = (5, 0)
#: The newest ``transformers`` release whose sources the uses here were checked against.
NEWEST_CHECKED = (5, 24)

#: The hooked methods and the parameters (after ``self``) the integration calls them with.
HOOKED: dict[str, tuple[str, ...]] = {
    "train": ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_load_best_model": (),
}
#: Hooked with the memory tier only (checked then): a memory step is taken when it returns.
MEMORY_HOOKED: dict[str, tuple[str, ...]] = {
    "_maybe_log_save_evaluate": ("tr_loss", "grad_norm", "model", "trial", "epoch"),
}
#: The writers ``_save_checkpoint`` calls, replaced for the duration of that call.
WRITERS: dict[str, tuple[str, ...]] = {
    "save_model": ("output_dir", "_internal_call"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_save_scaler": ("output_dir",),
    "_save_rng_state": ("output_dir",),
}
_TRAINER_MODULE = "transformers.trainer"


def version() -> tuple[int, int]:
    """The installed ``transformers`` release as ``(major, minor)``."""
    import transformers
    from packaging.version import Version

    release = Version(transformers.__version__).release
    return (release[0], release[1] if len(release) > 1 else 0)


def problems(trainer: Any) -> list[str]:
    """Why the integration cannot hook ``trainer``'s class in this ``transformers`` release
    (empty: it can): a release older than :data:`OLDEST_SUPPORTED`, or a hooked method missing
    or taking other parameters."""
    found = []
    installed = version()
    if installed < OLDEST_SUPPORTED:
        found.append(
            f"transformers {'.'.join(map(str, installed))} is older than the oldest supported "
            f"release {'.'.join(map(str, OLDEST_SUPPORTED))}"
        )
    return found + signature_problems(trainer, {**HOOKED, **WRITERS})


def signature_problems(trainer: Any, methods: dict[str, tuple[str, ...]]) -> list[str]:
    """Which of ``methods`` (name: its leading parameters after ``self``) ``trainer``'s class
    lacks or defines with other parameters (empty: none)."""
    found = []
    for name, params in methods.items():
        method = getattr(type(trainer), name, None)
        if method is None:
            found.append(f"Trainer.{name} does not exist")
            continue
        names = list(inspect.signature(method).parameters)[1:]
        if list(params) != names[: len(params)]:
            found.append(f"Trainer.{name} takes {names}, expected {list(params)}")
    return found


def newer_than_checked() -> bool:
    """Whether the installed release is newer than the sources this module was read against."""
    return version() > NEWEST_CHECKED


# --- the Trainer's own objects and settings


def deepspeed_enabled(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def fsdp_enabled(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False))


def run_dir(trainer: Any) -> str:
    """The directory ``checkpoint-N`` folders go to outside a hyper-parameter search trial
    (whose folders the Trainer writes its own way): ``args.output_dir``."""
    return str(trainer.args.output_dir)


def checkpoint_prefix() -> str:
    """``"checkpoint"``: the folders are ``{prefix}-{global_step}``."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return str(PREFIX_CHECKPOINT_DIR)


def state_file() -> str:
    """``"trainer_state.json"``: the Trainer's state in a checkpoint folder."""
    from transformers.trainer import TRAINER_STATE_NAME

    return str(TRAINER_STATE_NAME)


def last_checkpoint(output_dir: str) -> str | None:
    """What ``train(resume_from_checkpoint=True)`` resumes from: the ``checkpoint-N`` folder of
    the highest N in ``output_dir`` (None: none)."""
    from transformers.trainer_utils import get_last_checkpoint

    found: str | None = get_last_checkpoint(output_dir)
    return found


def hub_strategy(trainer: Any) -> str:
    """``args.hub_strategy`` as its value (``"every_save"``, ``"checkpoint"``, ...): it is a
    ``HubStrategy`` enum, whose ``str`` is ``"HubStrategy.CHECKPOINT"``."""
    strategy = getattr(trainer.args, "hub_strategy", "every_save")
    return str(getattr(strategy, "value", strategy))


def pretrained_model(trainer: Any) -> Any:
    """The Trainer's model unwrapped, when it is a ``PreTrainedModel`` without adapters (what
    ``from_pretrained`` loads); else None."""
    from transformers import PreTrainedModel

    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if isinstance(model, PreTrainedModel) and not getattr(model, "_hf_peft_config_loaded", False):
        return model
    return None


def write_small_files(trainer: Any, output_dir: str) -> None:
    """Write what ``Trainer._save`` writes into a checkpoint folder besides the weights, on the
    main process: the model's ``config.json`` and ``generation_config.json`` (and remote code),
    as ``save_pretrained`` writes them, the processing class's files (tokenizer, processor) and
    ``training_args.bin``."""
    import torch
    from transformers.trainer import TRAINING_ARGS_NAME

    model = pretrained_model(trainer)
    if model is not None:
        # what save_pretrained records in the config before writing it
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
        if model.is_remote_code():
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, output_dir, config=model.config)
        model.config.save_pretrained(output_dir)
        if model.can_generate():
            model.generation_config.save_pretrained(output_dir)
    processing = trainer.processing_class
    if processing is None:
        processing = getattr(trainer.data_collator, "tokenizer", None)
    if processing is not None:
        processing.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


# --- the preemption path: a step-end callback, the JIT checkpoint standing aside


def add_step_end_callback(trainer: Any, function: Callable[[Any], None]) -> None:
    """Make ``trainer`` call ``function(control)`` at every ``on_step_end`` (after each optimizer
    step, on every process; ``control``: the Trainer's ``TrainerControl``)."""
    from transformers import TrainerCallback

    class _StepEnd(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            function(control)
            return control

    trainer.add_callback(_StepEnd())


def add_epoch_end_callback(trainer: Any, function: Callable[[], None]) -> None:
    """Make ``trainer`` call ``function()`` at every ``on_epoch_end`` (on every process)."""
    from transformers import TrainerCallback

    class _EpochEnd(TrainerCallback):
        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            function()
            return control

    trainer.add_callback(_EpochEnd())


def stand_aside_jit_checkpoint(trainer: Any) -> bool:
    """Take the Trainer's JIT checkpoint out (see the module's notes): the SIGTERM handler it
    replaced is put back and its callback no longer acts. Returns whether there was one."""
    found = False
    for callback in getattr(trainer.callback_handler, "callbacks", []):
        manager = getattr(callback, "jit_manager", None)
        if type(callback).__name__ != "JITCheckpointCallback" or manager is None:
            continue
        own = getattr(manager, "_sigterm_handler", None)
        if own is not None and signal.getsignal(signal.SIGTERM) == own:
            before = manager._original_sigterm_handler
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        callback.jit_manager = None
        found = True
    return found


# --- hooking one instance


def hook(trainer: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Shadow ``trainer.<name>`` with ``make(own)``, ``own`` being the instance's bound method
    (a subclass's override included)."""
    own = getattr(trainer, name)
    setattr(trainer, name, functools.wraps(own)(make(own)))


@contextlib.contextmanager
def writers_replaced(trainer: Any, replacements: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Within the block, ``trainer``'s writers (:data:`WRITERS`) named in ``replacements`` are
    replaced by them; afterwards they are the instance's own again."""
    missing = object()
    saved = {name: vars(trainer).get(name, missing) for name in replacements}
    for name, function in replacements.items():
        setattr(trainer, name, function)
    try:
        yield
    finally:
        for name, before in saved.items():
            if before is missing:
                vars(trainer).pop(name, None)
            else:
                setattr(trainer, name, before)


# --- the launch flag: Trainers created once transformers.trainer is imported


def when_trainer_imported(action: Callable[[ModuleType], None]) -> None:
    """Run ``action(transformers.trainer)`` once that module is imported: now if it is, else
    right after the script's own import of it executes (an import hook that imports nothing
    itself: a script that never uses the Trainer never loads ``transformers``)."""
    module = sys.modules.get(_TRAINER_MODULE)
    if module is not None:
        action(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport):
            finder.actions.append(action)
            return
    sys.meta_path.insert(0, _AfterImport([action]))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` with the other finders, then runs the actions after the
    module executed."""

    def __init__(self, actions: list[Callable[[ModuleType], None]]) -> None:
        self.actions = actions
        self._busy = False

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != _TRAINER_MODULE or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        loader, actions = spec.loader, self.actions
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for action in actions:
                action(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_INIT_MARK = "_accelerate_incremental_wrapped"  # on the wrapped Trainer.__init__
_AFTER_INIT: list[Callable[[Any], None]] = []


def wrap_init(module: ModuleType, after: Callable[[Any], None]) -> None:
    """Make ``module.Trainer.__init__`` call ``after(trainer)`` once it returns (a subclass's
    ``__init__`` calls it through ``super()``); a second call replaces ``after``."""
    _AFTER_INIT[:] = [after]
    trainer_class = module.Trainer
    current = trainer_class.__init__
    if getattr(current, _INIT_MARK, False):
        return

    @functools.wraps(current)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        current(self, *args, **kwargs)
        for action in list(_AFTER_INIT):
            action(self)

    setattr(__init__, _INIT_MARK, True)
    trainer_class.__init__ = __init__
