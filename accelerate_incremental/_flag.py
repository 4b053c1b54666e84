"""The launch flag's settings, and :func:`enable` for scripts that opt in with one line.

With no edit to the script, ``accelerate launch ... -m accelerate_incremental --dirpath URL
train.py`` installs the integration in every process (:mod:`accelerate_incremental._launch`).
The environment variables work too; ``accelerate launch`` forwards its environment to every
process it starts (Accelerate's own config YAML rejects unknown keys)::

    ACCELERATE_INCREMENTAL=checkpoints/ accelerate launch --num_processes 2 train.py
    ACCELERATE_INCREMENTAL_CONFIG=incremental.json accelerate launch ... train.py

without ``-m accelerate_incremental`` they take effect where the script calls
``accelerate_incremental.enable(accelerator)`` after ``prepare``: without the flag it does
nothing and returns None; with it, it returns an
:class:`~accelerate_incremental.IncrementalCheckpointer` and installs the integration on that
accelerator (:meth:`~accelerate_incremental.IncrementalCheckpointer.take_over`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accelerate_incremental import _takeover
from accelerate_incremental.checkpointer import IncrementalCheckpointer
from lightning_incremental.core import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

ENV_DIR = "ACCELERATE_INCREMENTAL"
ENV_CONFIG = "ACCELERATE_INCREMENTAL_CONFIG"
_KEYS = {
    "dirpath",
    "keep_last",
    "every_n_steps",
    "storage_options",
    "options",
    "watchdog",
    "heartbeat_interval",
    "heartbeat_timeout",
    "progress_timeout",
    "max_consecutive_failures",
    "replica_check",
    "optimizer_state",
    "max_overhead",
    "expected_mtbf",
    "materialize",
    "memory_every_n_steps",
    "memory_replicas",
    "memory_dir",
    "fork_from",
    "fork_weights_only",
}
_NOT_PATHS = {"0", "1", "true", "false", "yes", "no", "on", "off"}


def settings(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The checkpointer settings the launch flag asks for; None when the flag is not set.

    Raises:
        ConfigError: a bad flag value, both variables set, or an unreadable / invalid config file.
    """
    env = os.environ if environ is None else environ
    dirpath = env.get(ENV_DIR)
    config = env.get(ENV_CONFIG)
    if dirpath is not None and config is not None:
        raise ConfigError(
            f"set either {ENV_DIR} (a directory/URL) or {ENV_CONFIG} (a JSON file), not both"
        )
    if dirpath is not None:
        return dir_settings(
            dirpath,
            f"{ENV_DIR}",
            f"{ENV_DIR}=ckpts/",
            f"unset {ENV_DIR} to disable incremental checkpointing",
        )
    if config is None:
        return None
    return file_settings(config, f"{ENV_CONFIG}={config!r}")


def dir_settings(dirpath: str, name: str, example: str, hint: str = "") -> dict[str, Any]:
    """The settings for the store ``dirpath`` given as ``name`` (``example`` shows a good value;
    ``hint`` ends the error message).

    Raises:
        ConfigError: ``dirpath`` is empty or a boolean word (the flag taken for a switch).
    """
    if not dirpath.strip() or dirpath.strip().lower() in _NOT_PATHS:
        raise ConfigError(
            f"{name} must be the checkpoint directory or URL (e.g. {example} or "
            f"s3://bucket/run), got {dirpath!r}" + (f"; {hint}" if hint else "")
        )
    return {"dirpath": dirpath}


def file_settings(path: str, name: str) -> dict[str, Any]:
    """The settings of the JSON config file ``path``, named ``name`` in errors.

    Raises:
        ConfigError: an unreadable file, invalid JSON, unknown keys or no ``dirpath``.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the config file: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"{name}: unknown keys {unknown}; allowed: {sorted(_KEYS)}")
    if not isinstance(data.get("dirpath"), str) or not data["dirpath"]:
        raise ConfigError(f"{name}: 'dirpath' (a directory or URL) is required")
    options = data.pop("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{name}: 'options' must be an object")
    return {**data, **options}


def enable(
    accelerator: Accelerator, dirpath: str | None = None, **kwargs: Any
) -> IncrementalCheckpointer | None:
    """Route ``accelerator.save_state`` / ``load_state`` through an incremental checkpointer.

    With ``dirpath`` it is enabled unconditionally; without, only when the launch flag
    (``ACCELERATE_INCREMENTAL`` or ``ACCELERATE_INCREMENTAL_CONFIG``) is set — otherwise it returns
    None and the accelerator is untouched. ``kwargs`` go to :class:`IncrementalCheckpointer`.

    Called again for the same accelerator (or for one the launch module already enabled), it
    returns the checkpointer it has.

    Takeover: the accelerator *instance* gets ``save_state`` and ``load_state`` attributes that
    shadow its methods (the class and other accelerators are untouched), and its prepared
    DataLoaders iterated directly (``for batch in loader``) are tracked, so a mid-epoch resume
    continues after the last batch consumed before the checkpoint (see
    :meth:`IncrementalCheckpointer.take_over`). ``save_state()`` saves
    the whole state as checkpoint ``project_configuration.iteration`` and increments it, like
    Accelerate; ``load_state()`` restores the newest committed checkpoint and returns its step.
    Their ``output_dir`` / ``input_dir`` arguments are ignored: the store is ``dirpath``.

    Raises:
        ConfigError: a bad flag value or config file.
        ValueError: arguments for an accelerator already enabled.
        TypeError / ValueError: see :class:`IncrementalCheckpointer`.
    """
    existing = _takeover.installed(accelerator)
    if existing is not None:
        if dirpath is not None or kwargs:
            raise ValueError(
                f"this accelerator is already enabled, with the store {existing.store.url} (by "
                "`-m accelerate_incremental` on the launch line, or an earlier enable); call "
                "enable(accelerator) without arguments to get its checkpointer"
            )
        checkpointer: IncrementalCheckpointer = existing
        return checkpointer
    if dirpath is not None:
        config: dict[str, Any] = {"dirpath": dirpath}
    else:
        found = settings()
        if found is None:
            return None
        config = found
    checkpointer = IncrementalCheckpointer(accelerator, **{**config, **kwargs})
    checkpointer.take_over()
    return checkpointer


__all__ = ["ENV_CONFIG", "ENV_DIR", "enable", "settings"]
