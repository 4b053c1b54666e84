"""Turning a Hugging Face ``Trainer``'s checkpoints incremental: :func:`enable_trainer` (one line
in a script) and :func:`from_flag` (every Trainer of a script run with ``accelerate launch ... -m
accelerate_incremental``), with the start-up checks both make.

Why a function and not a ``TrainerCallback``: a callback cannot change where the Trainer's
checkpoints go. ``on_save`` runs after the full ``checkpoint-N`` folder was written (the bytes
are already spent), and the Trainer restores a checkpoint before any callback event of
``train()`` (the weights even before ``on_train_begin``). :func:`enable_trainer` hooks the
Trainer's own save and load points on that one instance instead (see
:mod:`accelerate_incremental.trainer.hf_compat`), and returns the
:class:`~accelerate_incremental.trainer.checkpointer.TrainerCheckpointer` (``.wait()``, ``.store``).

What cannot be covered is said at start-up, naming the reason and what the user gets instead:
:func:`enable_trainer` raises ``ValueError`` (it was asked for explicitly); under the launch flag
the run goes on with the Trainer's own full checkpoints and a warning says so.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

from accelerate_incremental._flag import settings
from accelerate_incremental.trainer import checkpointer as _trainer
from accelerate_incremental.trainer import hf_compat as _hf_compat
from accelerate_incremental.trainer.checkpointer import TrainerCheckpointer

log = logging.getLogger("lightning_incremental")
# Each enabled Trainer's checkpointer, by a weak reference: a checkpointer refers to its Trainer,
# and a strong value would keep its key (and the model, optimizer and store) alive for good. The
# Trainer's own hooks refer to the checkpointer, which so lives exactly as long as the Trainer.
_ENABLED: weakref.WeakKeyDictionary[Any, weakref.ref[TrainerCheckpointer]] = (
    weakref.WeakKeyDictionary()
)


def _enabled(trainer: Any) -> TrainerCheckpointer | None:
    found = _ENABLED.get(trainer)
    return found() if found is not None else None


# The flag's settings the Trainer's own arguments replace: ignored for a Trainer, with a warning.
_TRAINER_OWNS = {
    "keep_last": "save_total_limit",
    "every_n_steps": "save_steps / save_strategy",
}
_RECOVERY = {
    "watchdog",
    "heartbeat_interval",
    "heartbeat_timeout",
    "progress_timeout",
    "replica_check",
    "recovery",
}


def refusals(trainer: Any) -> list[str]:
    """Why ``trainer``'s checkpoints cannot go through the store (empty: they can)."""
    found = list(_hf_compat.problems(trainer))
    if _hf_compat.deepspeed_enabled(trainer):
        found.append("DeepSpeed is enabled (its engine writes its own sharded checkpoints)")
    if _hf_compat.fsdp_enabled(trainer):
        found.append("FSDP is enabled (sharded Trainer checkpoints are not covered yet)")
    args = trainer.args
    strategy = _hf_compat.hub_strategy(trainer)
    if args.push_to_hub and strategy in ("checkpoint", "all_checkpoints"):
        found.append(
            f"push_to_hub with hub_strategy={strategy!r} uploads checkpoint folders to resume from "
            "the Hub, which would hold only a marker (use hub_strategy='every_save' or 'end')"
        )
    return found


def notes(trainer: Any, ignored: list[str]) -> list[str]:
    """What works differently than the user may expect, said at start-up."""
    args = trainer.args
    found = []
    if str(args.save_strategy).lower().endswith("no"):
        found.append("save_strategy='no': the Trainer saves no checkpoint, so none is written")
    if args.save_only_model:
        found.append(
            "save_only_model=True: the store keeps the whole training state anyway (unchanged "
            "chunks cost nothing), so a resume is exact"
        )
    if args.push_to_hub:
        found.append(
            "push_to_hub: each checkpoint-N folder also gets the model files in full, for the "
            "upload; the optimizer and the rest stay incremental"
        )
    if _hf_compat.newer_than_checked():
        found.append(
            f"transformers {'.'.join(map(str, _hf_compat.version()))} is newer than the release "
            f"the Trainer hooks were checked against "
            f"({'.'.join(map(str, _hf_compat.NEWEST_CHECKED))}); their signatures match"
        )
    found.extend(ignored)
    return found


def _split(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``config`` keys a :class:`TrainerCheckpointer` takes, and notes on those it ignores."""
    kept: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in config.items():
        if key in _TRAINER_OWNS:
            if value is not None:
                ignored.append(f"{key} is ignored for a Trainer: its {_TRAINER_OWNS[key]} rules")
        elif key in _RECOVERY:
            ignored.append(f"{key} is not used for a Trainer (no watchdog or replica check)")
        else:
            kept[key] = value
    return kept, ignored


def enable_trainer(
    trainer: Any, dirpath: str | None = None, **kwargs: Any
) -> TrainerCheckpointer | None:
    """Route ``trainer``'s checkpoints (at its own ``save_strategy`` / ``save_steps``) through
    an incremental store; call it on every process, after creating the Trainer, before ``train``.

    With ``dirpath`` it is enabled unconditionally; without, only when the launch flag
    (``ACCELERATE_INCREMENTAL`` or ``ACCELERATE_INCREMENTAL_CONFIG``) is set — else it returns
    None and the Trainer is untouched. Called again for the same Trainer, or for one the launch
    flag enabled, it returns the checkpointer it has. ``kwargs``: ``auto_resume`` (default True:
    ``train()`` resumes from the newest committed checkpoint), ``storage_options``,
    ``optimizer_state``, ``max_consecutive_failures``, ``preemption`` (default True: a SIGTERM
    saves the step every process reaches next, then they exit 143), ``materialize`` (``"last"``,
    ``"best"`` or True: when ``train()`` ends, those ``checkpoint-N`` folders also get the
    model's weights, so ``from_pretrained`` loads them), ``fork_from`` (``"SRC[@STEP]"``: while
    the store holds no checkpoint, fork that step into it first, as IncrementalCheckpointer does),
    ``fork_weights_only`` (True: a ``train()`` that resumes no checkpoint starts from the forked
    step's model weights, at step 0), ``memory_every_n_steps``, ``memory_replicas`` and
    ``memory_dir`` (the memory tier: node-local memory every so many steps, with replicas on
    other nodes; off by default) and store options (``full_every``, ...).

    Raises:
        ValueError: a Trainer this integration cannot cover (DeepSpeed, FSDP, an unsupported
            ``transformers`` release, ``hub_strategy`` uploading checkpoints), naming why; or
            arguments for a Trainer already enabled.
        ConfigError: a bad flag value or store option.
    """
    existing = _enabled(trainer)
    if existing is not None:
        if dirpath is not None or kwargs:
            raise ValueError(
                f"this Trainer is already enabled, with the store {existing.url}; call "
                "enable_trainer(trainer) without arguments to get its checkpointer"
            )
        return existing
    if dirpath is not None:
        config: dict[str, Any] = {"dirpath": dirpath, **kwargs}
    else:
        found = settings()
        if found is None:
            return None
        config = {**found, **kwargs}
    refused = refusals(trainer)
    if refused:
        raise ValueError(
            "cannot route this Trainer's checkpoints through the incremental store: "
            + "; ".join(refused)
            + ". Without enable_trainer it writes its own full checkpoint-N folders"
        )
    return _start(trainer, config)


def _start(trainer: Any, config: dict[str, Any]) -> TrainerCheckpointer:
    kept, ignored = _split(config)
    checkpointer = TrainerCheckpointer(trainer, **kept)
    _ENABLED[trainer] = weakref.ref(checkpointer)
    for note in notes(trainer, ignored):
        _trainer.announce(trainer, note)
        warnings.warn(f"accelerate_incremental: {note}", UserWarning, stacklevel=3)
    _trainer.announce(
        trainer,
        f"Trainer checkpoints go to {checkpointer.url} (incremental), at the Trainer's own "
        f"save_strategy={str(trainer.args.save_strategy).rsplit('.', 1)[-1].lower()!r}; "
        f"{trainer.args.output_dir}/checkpoint-N folders hold a marker and the Trainer's small "
        "files (config, tokenizer, trainer_state.json), not the weights",
    )
    return checkpointer


def from_flag(trainer: Any, config: dict[str, Any]) -> TrainerCheckpointer | None:
    """The launch flag's step for each new Trainer (right after its ``__init__``): enable it
    with ``config``, or warn why it cannot be and leave it writing its own checkpoints. Either
    way the flag's generic accelerator takeover leaves the Trainer's accelerator alone."""
    _trainer.own_accelerator(trainer.accelerator)
    existing = _enabled(trainer)
    if existing is not None:
        return existing
    refused = refusals(trainer)
    if refused:
        message = (
            "accelerate_incremental: this Trainer's checkpoints are NOT incremental: "
            + "; ".join(refused)
            + ". It writes its own full checkpoint-N folders to "
            + f"{trainer.args.output_dir}, and the store {config.get('dirpath')} is not used"
        )
        log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)
        return None
    return _start(trainer, config)


def install(config: dict[str, Any]) -> None:
    """Enable, with ``config``, every Trainer created from now on in this process, once the
    script imports ``transformers.trainer`` (nothing is imported before)."""
    settings_now = dict(config)

    def after_init(trainer: Any) -> None:
        from_flag(trainer, settings_now)

    def hook_init(module: Any) -> None:
        _hf_compat.wrap_init(module, after_init)

    _hf_compat.when_trainer_imported(hook_init)
