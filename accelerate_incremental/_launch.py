"""``accelerate launch [options] -m accelerate_incremental [--dirpath URL | --config FILE]
train.py [script args]``: incremental checkpointing for an unmodified script.

Accelerate's ``-m/--module`` makes every process it starts run ``python -m accelerate_incremental
...`` (everything after the module name is this module's command line). Here, in each process:

1. The flags are parsed and checked, with the store settings, before the script runs: a bad value
   ends the process with a usage error (exit status 2) naming it.
2. ``Accelerator.prepare`` is wrapped (the class attribute, once per process): after each
   ``prepare`` of an accelerator that holds a prepared model, that instance is enabled as
   :func:`accelerate_incremental.enable` does — its ``save_state`` / ``load_state`` go through
   the incremental store and its prepared DataLoaders' own iteration is tracked, so a mid-epoch
   resume is exact in a plain ``for batch in loader`` — and later ``prepare`` calls add their
   DataLoaders and optimizers.
3. A Hugging Face ``Trainer`` the script creates gets its checkpoints routed through the store
   at its own cadence (:func:`accelerate_incremental.enable_trainer`), or a start-up warning
   saying why not; its accelerator is left to it. ``transformers`` is never imported for this:
   the Trainer class is hooked when the script itself imports ``transformers.trainer``.
4. The script runs as ``__main__``, as ``python train.py [script args]`` would run it:
   ``sys.argv``, ``__file__``, ``sys.path[0]`` (the script's directory), exit status,
   exceptions and signals are the script's own. At exit, after the stores drained, a gloo
   process group the script left is destroyed (:func:`end_gloo_group`).

Without ``--dirpath`` / ``--config`` the environment variables ``ACCELERATE_INCREMENTAL`` /
``ACCELERATE_INCREMENTAL_CONFIG`` give the store; the flags take precedence over them.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from accelerate_incremental import _compat, _takeover
from accelerate_incremental._arguments import check_arguments
from accelerate_incremental._flag import (
    ENV_CONFIG,
    ENV_DIR,
    dir_settings,
    enable,
    file_settings,
    settings,
)
from accelerate_incremental.checkpointer import IncrementalCheckpointer
from accelerate_incremental.trainer import checkpointer as _trainer
from accelerate_incremental.trainer import enable as _trainer_enable
from lightning_incremental.core import ConfigError
from lightning_incremental.core.codecs.optimizer_state import POLICIES

USAGE = (
    "accelerate launch [accelerate options] -m accelerate_incremental "
    "[--dirpath URL | --config FILE] script [script args]"
)
_MARK = "_accelerate_incremental_settings"  # on the wrapped prepare: the settings it applies


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        prog="accelerate_incremental",
        usage=USAGE,
        allow_abbrev=False,
        description="Run an unmodified Accelerate training script with incremental checkpoints: "
        "its accelerator.save_state() / load_state() go through the incremental store, and a "
        "mid-epoch resume continues after the last batch consumed before the checkpoint.",
        epilog=f"Without --dirpath or --config, {ENV_DIR} or {ENV_CONFIG} gives the store.",
    )
    store = out.add_mutually_exclusive_group()
    store.add_argument(
        "--dirpath", metavar="URL", help="the checkpoint store: a directory or fsspec URL"
    )
    store.add_argument(
        "--config",
        metavar="FILE",
        help='a JSON file of settings: {"dirpath": URL, "keep_last": 3, "every_n_steps": ..., '
        '"storage_options": {...}, "options": {...}, "replica_check": ..., ...}',
    )
    out.add_argument(
        "--optimizer-state",
        choices=POLICIES,
        default=None,
        help="how optimizer moments are stored: exact (default, bit-exact), bf16 or int8 "
        "(quantized: fewer bytes, resumes are not bit-exact)",
    )
    out.add_argument("script", help="the training script, run as __main__")
    out.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return out


def parse(argv: Sequence[str]) -> tuple[dict[str, Any], str, list[str]]:
    """The checkpointer settings, the script and its arguments from this module's command line.

    Raises:
        SystemExit: status 2 with a usage message: a bad flag or setting, no store, no script.
    """
    cli = parser()
    args = cli.parse_args(list(argv))
    try:
        found: dict[str, Any] | None
        if args.dirpath is not None:
            found = dir_settings(args.dirpath, "--dirpath", "--dirpath ckpts/")
            if os.path.isfile(args.dirpath):
                cli.error(
                    f"--dirpath {args.dirpath!r} is a file: give the checkpoint directory or URL "
                    "first, then the script"
                )
        elif args.config is not None:
            found = file_settings(args.config, f"--config {args.config!r}")
        else:
            found = settings()
        if found is None:
            cli.error(
                f"no checkpoint store: give --dirpath URL or --config FILE (or set {ENV_DIR} / "
                f"{ENV_CONFIG})"
            )
        if args.optimizer_state is not None:
            found["optimizer_state"] = args.optimizer_state
        check_arguments(**found)
    except (ConfigError, TypeError, ValueError) as exc:
        cli.error(str(exc))
    if not os.path.exists(args.script):
        cli.error(f"the training script {args.script!r} does not exist")
    return found, args.script, list(args.script_args)


def install(config: dict[str, Any]) -> None:
    """Enable every accelerator this process prepares a model with, with ``config`` (the
    keyword arguments of :class:`~accelerate_incremental.IncrementalCheckpointer`)."""
    from accelerate import Accelerator

    _trainer_enable.install(config)
    current = Accelerator.prepare
    if hasattr(current, _MARK):
        setattr(current, _MARK, dict(config))
        return

    @functools.wraps(current)
    def prepare(self: Accelerator, *args: Any, **kwargs: Any) -> Any:
        result = current(self, *args, **kwargs)
        attach(self, getattr(prepare, _MARK))
        return result

    setattr(prepare, _MARK, dict(config))
    Accelerator.prepare = prepare


def attach(accelerator: Any, config: dict[str, Any]) -> IncrementalCheckpointer | None:
    """Enable ``accelerator`` once it holds a prepared model; afterwards, follow what later
    ``prepare`` calls add. Returns its checkpointer (None while no model is prepared, and for
    a Trainer's accelerator: the Trainer saves, loads and skips batches its own way, see
    :mod:`accelerate_incremental.trainer.checkpointer`)."""
    if _trainer.owned_by_trainer(accelerator):
        return None
    existing: IncrementalCheckpointer | None = _takeover.installed(accelerator)
    if existing is not None:
        existing.follow()
        return existing
    if not _compat.models(accelerator):
        return None
    # materialize is a Trainer setting (its checkpoint-N folders): nothing to do here
    return enable(accelerator, **{k: v for k, v in config.items() if k != "materialize"})


def run_script(script: str, script_args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args``, as ``python script ...`` would."""
    sys.argv = [script, *script_args]
    if os.path.isfile(script) and not sys.flags.safe_path:
        # python script.py puts the script's directory first (a directory or zip script is put
        # there by runpy itself)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def end_gloo_group() -> None:
    """At interpreter exit (an ``atexit`` hook, after the stores drained their saves): destroy a
    gloo default process group the script left, while the interpreter is whole. Left to
    interpreter teardown, gloo's worker threads can end a process that finished with
    ``terminate called without an active exception`` (exit 134), which ``accelerate launch``
    reports as a failed run. Other backends are left as they are."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def asked_processes(launcher: Sequence[str]) -> int | None:
    """The ``--num_processes`` (``--num-processes``) of an ``accelerate launch`` command line;
    None when it names none."""
    for i, arg in enumerate(launcher):
        for flag in ("--num_processes", "--num-processes"):
            value = arg[len(flag) + 1 :] if arg.startswith(flag + "=") else None
            if arg == flag and i + 1 < len(launcher):
                value = launcher[i + 1]
            if value is not None:
                return int(value) if value.isdigit() else None
    return None


def _launcher() -> list[str]:
    """The command line of the process that started this one (``accelerate launch``'s, when it
    ran the script in one process itself); empty where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def check_world(launcher: Sequence[str], world_size: int) -> str | None:
    """Why the launched world is not the one asked for (None: it is): ``accelerate launch
    --num_processes N`` on a machine without GPUs starts ONE process unless ``--multi_gpu``
    says to start N (with torchrun; they still train on the CPU), and the run would go on alone
    with every step counted once where N processes would have split the batches."""
    by_accelerate = any(a in ("launch", "accelerate.commands.launch") for a in launcher)
    asked = asked_processes(launcher) if by_accelerate else None
    if asked is None or asked <= 1 or world_size != 1:
        return None
    return (
        f"accelerate launch --num_processes {asked} started one process (WORLD_SIZE unset): "
        "without GPUs it starts several only with --multi_gpu (they train on the CPU, over "
        f"gloo): accelerate launch --multi_gpu --num_processes {asked} -m accelerate_incremental "
        "... (or drop --num_processes to train in one process)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """The module's entry point: parse, install, run the script.

    Raises:
        SystemExit: status 2 with a usage message (a bad flag or setting, or a launch that
            started fewer processes than it was asked for).
    """
    config, script, script_args = parse(sys.argv[1:] if argv is None else argv)
    wrong = check_world(_launcher(), int(os.environ.get("WORLD_SIZE", "1")))
    if wrong is not None:
        parser().error(wrong)
    install(config)
    atexit.register(end_gloo_group)  # first registered: runs after the script's own hooks
    run_script(script, script_args)
