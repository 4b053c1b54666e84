"""What a ``checkpoint-N`` folder holds besides its marker, and ``materialize``.

Every folder the integration writes holds what the Trainer writes there apart from the weights,
optimizer, scheduler, scaler and random states (:func:`~.hf_compat.write_small_files`:
``config.json``, ``generation_config.json``, the tokenizer or processor files,
``training_args.bin``; the Trainer adds ``trainer_state.json``), and a short :data:`README`
saying where the weights are and how to get them as files. ``from_pretrained`` on such a folder
fails with transformers' own message (no ``model.safetensors``); the README is what the user
finds there.

``materialize`` (``"last"``, ``"best"``, True for both): when ``train()`` ends, the chosen
folders get the model's weights as ``save_pretrained`` writes them, from the store (verified,
bit-exact), so ``from_pretrained(folder)`` loads them. The marker stays: a resume from the folder
still restores the whole training state from the store, and the store keeps the step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from accelerate_incremental.trainer import hf_compat as _hf_compat
from accelerate_incremental.trainer import markers
from lightning_incremental.core import CheckpointStore, ConfigError

README = "README.md"
KINDS = ("last", "best")


def materialize_option(value: Any) -> tuple[str, ...]:
    """``materialize`` as the kinds it asks for (empty: off).

    Raises:
        ConfigError: anything but a bool, ``"last"``, ``"best"`` or a list of them.
    """
    if value is False or value is None:
        return ()
    if value is True:
        return KINDS
    kinds = [value] if isinstance(value, str) else value
    if not isinstance(kinds, (list, tuple, set, frozenset)) or not all(k in KINDS for k in kinds):
        raise ConfigError(
            f"materialize must be True, False, 'last', 'best' or a list of them, got {value!r}"
        )
    return tuple(k for k in KINDS if k in kinds)


def readme(store: str, step: int, folder: str) -> str:
    """The README of a folder whose weights are step ``step`` of ``store``."""
    return (
        f"# {os.path.basename(os.path.normpath(folder))}: an incremental checkpoint\n\n"
        f"The weights, optimizer, scheduler, scaler and random states of this checkpoint are\n"
        f"step {step} of the incremental checkpoint store `{store}`\n"
        f"(`{markers.NAME}` names it). The other files are the Trainer's own.\n\n"
        '- Resume training: `trainer.train(resume_from_checkpoint="<this folder>")` with the\n'
        "  integration enabled, as with any checkpoint folder.\n"
        '- Load the model with `from_pretrained("<this folder>")`: first write its weights\n'
        "  into this folder:\n\n"
        f"      lightning-incremental export {store} {step} --format hf --to {folder}\n\n"
        '  or pass `materialize="last"` / `"best"` / `True` to `enable_trainer` (the\n'
        "  launch flag's `materialize` key): the run writes them when `train()` ends.\n"
    )


def write_folder(trainer: Any, folder: str, store: str, step: int) -> None:
    """On the main process: the marker of ``folder`` (first: a folder cut short still says where
    its checkpoint is), the README and the small files."""
    markers.write(folder, store, step)
    with open(os.path.join(folder, README), "w", encoding="utf-8") as fh:
        fh.write(readme(store, step, folder))
    _hf_compat.write_small_files(trainer, folder)


def chosen(trainer: Any, kinds: tuple[str, ...], url: str) -> dict[str, markers.Marker]:
    """The folders ``kinds`` names that hold a marker of ``url``: ``last`` the newest
    ``checkpoint-N`` of the run, ``best`` the Trainer's ``best_model_checkpoint``."""
    found: dict[str, markers.Marker] = {}
    candidates = []
    if "last" in kinds and os.path.isdir(_hf_compat.run_dir(trainer)):
        candidates.append(_hf_compat.last_checkpoint(_hf_compat.run_dir(trainer)))
    if "best" in kinds:
        candidates.append(trainer.state.best_model_checkpoint)
    for folder in candidates:
        marker = markers.read(folder) if folder else None
        if marker is not None and marker.store == url:
            found[os.path.realpath(folder)] = marker
    return found


def materialize(trainer: Any, store: CheckpointStore, kinds: tuple[str, ...]) -> list[str]:
    """On the main process, every save committed: write the model's weights into the folders
    ``kinds`` names, from the store, as ``save_pretrained`` writes them; returns the folders.

    Raises:
        ValueError: the Trainer's model is not a ``PreTrainedModel`` (nothing to load with
            ``from_pretrained``).
    """
    targets = chosen(trainer, kinds, str(store.url))
    if not targets:
        return []
    model = _hf_compat.pretrained_model(trainer)
    if model is None:
        raise ValueError(
            "materialize writes weights for from_pretrained, but the Trainer's model is not a "
            "transformers PreTrainedModel (or carries adapters): use "
            "`lightning-incremental export STORE STEP --format hf` or trainer.save_model()"
        )
    for folder, marker in targets.items():
        weights = store.load(marker.step, map_location="cpu", keys="model")["model"]
        model.save_pretrained(folder, state_dict=weights, is_main_process=True)
        del weights
        with contextlib.suppress(FileNotFoundError):  # the folder now loads as it is
            os.remove(os.path.join(folder, README))
    return list(targets)
