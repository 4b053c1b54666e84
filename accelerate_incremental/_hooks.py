"""Accelerate's save/load state pre-hooks, run by the taken-over ``save_state`` / ``load_state``.

``accelerator.register_save_state_pre_hook(hook)`` and ``register_load_state_pre_hook(hook)``
let a script save or load more than the state (a model config, a model it saves itself). Their
contract, from ``Accelerator.save_state`` / ``load_state``:

- save: ``hook(models, weights, output_dir)`` on every process before anything is written;
  ``models`` is ``accelerator._models``, ``weights`` the list of their state dicts — what is
  saved, so a hook that saves a model itself removes its entry (``weights.pop()``), and one
  that changes a state dict changes what is saved; ``output_dir`` is the checkpoint directory
  (created first).
- load: ``hook(models, input_dir)`` on every process before the weights are loaded; ``models``
  is a list of ``accelerator._models`` — a hook that loads a model itself removes it, and the
  checkpoint's weights go, in order, to the models left.

With the takeover the state goes to the incremental store; the directory still exists for the
hooks' own files and is the one Accelerate would use: with
``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``<project_dir>/checkpoints/
checkpoint_<iteration>`` (on load: that of the checkpoint restored), otherwise the
``output_dir`` / ``input_dir`` argument. Without such a directory the call fails, as
Accelerate's own does, rather than skip the hooks.

One difference: ``weights`` are the unwrapped models' state dicts (what the store saves), so
under DDP their keys lack DDP's ``module.`` prefix that Accelerate's own ``weights`` carry.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate_incremental import _compat


def run_save_hooks(accelerator: Any, output_dir: Any, iteration: int) -> list[dict[str, Any]]:
    """Run the registered save pre-hooks; returns the ``weights`` list to save (after them).

    Raises:
        ValueError: there is no checkpoint directory to give the hooks.
    """
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        directory = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{iteration}")
    elif output_dir is not None:
        directory = os.fspath(output_dir)
    else:
        raise ValueError(
            "accelerator.save_state() without output_dir: the save pre-hooks registered with "
            "register_save_state_pre_hook get the checkpoint directory, and there is none; pass "
            "save_state(output_dir) or use ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    os.makedirs(directory, exist_ok=True)
    models = _compat.models(accelerator)
    weights = [accelerator.unwrap_model(m).state_dict() for m in models]
    for hook in _compat.save_state_pre_hooks(accelerator):
        hook(models, weights, directory)
    return weights


def load_hooks_for(accelerator: Any, input_dir: Any) -> Any:
    """A function of the restored step that runs the registered load pre-hooks and returns the
    models the checkpoint's weights go to (None when no hook is registered).

    Raises:
        ValueError: ``input_dir`` is not a directory, or there is none to give the hooks.
    """
    if not _compat.load_state_pre_hooks(accelerator):
        return None
    config = accelerator.project_configuration
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif not config.automatic_checkpoint_naming:
        raise ValueError(
            "accelerator.load_state() without input_dir: the load pre-hooks registered with "
            "register_load_state_pre_hook get the checkpoint directory, and there is none; pass "
            "load_state(input_dir) or use ProjectConfiguration(automatic_checkpoint_naming=True)"
        )

    def run(step: int) -> list[Any]:
        directory = input_dir
        if directory is None:
            directory = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{step}")
            if not os.path.isdir(directory):
                raise ValueError(
                    f"the load pre-hooks get the directory of the checkpoint restored (step "
                    f"{step}), {directory}, which does not exist: was it saved with "
                    "accelerator.save_state?"
                )
        models = list(_compat.models(accelerator))
        for hook in _compat.load_state_pre_hooks(accelerator):
            hook(models, directory)
        return models

    return run
