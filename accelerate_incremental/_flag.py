"""The launch flag: enable incremental checkpointing for an ``accelerate launch`` run.

``accelerate launch`` forwards its environment to every process it starts, and Accelerate's own
config YAML rejects unknown keys, so the flag is an environment variable set on the launch line::

    ACCELERATE_INCREMENTAL=checkpoints/ accelerate launch --num_processes 2 train.py
    ACCELERATE_INCREMENTAL_CONFIG=incremental.json accelerate launch ... train.py

The script calls ``accelerate_incremental.enable(accelerator)`` once after ``prepare``: without
the flag it does nothing and returns None; with it, it returns an
:class:`~accelerate_incremental.IncrementalCheckpointer` and routes ``accelerator.save_state`` /
``accelerator.load_state`` through it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

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
}
_NOT_PATHS = {"0", "1", "true", "false", "yes", "no", "on", "off"}


def settings(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
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
        if not dirpath.strip() or dirpath.strip().lower() in _NOT_PATHS:
            raise ConfigError(
                f"{ENV_DIR} must be the checkpoint directory or URL (e.g. {ENV_DIR}=ckpts/ or "
                f"s3://bucket/run), got {dirpath!r}; unset it to disable incremental checkpointing"
            )
        return {"dirpath": dirpath}
    if config is None:
        return None
    try:
        with open(config, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"{ENV_CONFIG}={config!r}: cannot read the config file: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV_CONFIG}={config!r}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{ENV_CONFIG}={config!r}: expected a JSON object, got {type(data).__name__}"
        )
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(
            f"{ENV_CONFIG}={config!r}: unknown keys {unknown}; allowed: {sorted(_KEYS)}"
        )
    if not isinstance(data.get("dirpath"), str) or not data["dirpath"]:
        raise ConfigError(f"{ENV_CONFIG}={config!r}: 'dirpath' (a directory or URL) is required")
    options = data.pop("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{ENV_CONFIG}={config!r}: 'options' must be an object")
    return {**data, **options}


def enable(
    accelerator: Accelerator, dirpath: str | None = None, **kwargs: Any
) -> IncrementalCheckpointer | None:
    """Route ``accelerator.save_state`` / ``load_state`` through an incremental checkpointer.

    With ``dirpath`` it is enabled unconditionally; without, only when the launch flag
    (``ACCELERATE_INCREMENTAL`` or ``ACCELERATE_INCREMENTAL_CONFIG``) is set — otherwise it returns
    None and the accelerator is untouched. ``kwargs`` go to :class:`IncrementalCheckpointer`.

    Takeover: the accelerator *instance* gets ``save_state`` and ``load_state`` attributes that
    shadow its methods (the class and other accelerators are untouched). ``save_state()`` saves
    the whole state as checkpoint ``project_configuration.iteration`` and increments it, like
    Accelerate; ``load_state()`` restores the newest committed checkpoint and returns its step.
    Their ``output_dir`` / ``input_dir`` arguments are ignored: the store is ``dirpath``.

    Raises:
        ConfigError: a bad flag value or config file.
        TypeError / ValueError: see :class:`IncrementalCheckpointer`.
    """
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
