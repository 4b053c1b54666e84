"""Start a run's store as a fork of another run's checkpoint (``fork_from="SRC[@STEP]"``):
framework-free, shared by the Lightning and Accelerate plug-ins.

The first run forks (:meth:`~lightning_incremental.core.CheckpointStore.fork`: no copy of the
step, a pin in the source); a restart finds its store already holding checkpoints and only checks
that they were forked from the same source. The caller runs :func:`ensure_fork` on one rank
before any rank opens the store; the resume path then loads the forked step as any other.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_incremental.core import CheckpointNotFoundError, CheckpointStore, ConfigError
from lightning_incremental.core.commit.history import FORK_BASE
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.pool import open_location, read_links


def split_step(source: str) -> tuple[str, int | None]:
    """``SRC@STEP`` -> (SRC, STEP); a source without ``@<digits>`` has no step."""
    head, sep, tail = source.rpartition("@")
    if sep and tail.isdigit() and head:
        return head, int(tail)
    return source, None


def check_source(
    fork_from: str | os.PathLike[str] | None, *, resume: bool = True, weights_only: Any = False
) -> str | None:
    """``fork_from`` as given to a plug-in: None, or a non-empty ``SRC[@STEP]`` (which needs
    ``resume``: the run starts from the forked step); ``weights_only`` (``fork_weights_only``)
    is a bool, and True only with a ``fork_from``."""
    if not isinstance(weights_only, bool):
        raise TypeError(f"fork_weights_only must be a bool, got {weights_only!r}")
    if fork_from is None:
        if weights_only:
            raise ConfigError("fork_weights_only=True needs fork_from='SRC[@STEP]'")
        return None
    if not resume:
        raise ConfigError("fork_from starts the run from the forked step: it needs resume=True")
    text = os.fspath(fork_from) if isinstance(fork_from, (str, os.PathLike)) else None
    if not isinstance(text, str) or not split_step(text)[0]:
        raise ConfigError(f"fork_from expects 'SRC' or 'SRC@STEP', got {fork_from!r}")
    return text


def ensure_fork(
    dst: str,
    fork_from: str,
    storage_options: dict[str, Any] | None = None,
    *,
    weights_only: bool = False,
) -> int | None:
    """Fork ``fork_from`` (``SRC[@STEP]``) into ``dst`` unless ``dst`` already holds a store;
    returns the step forked now, None when ``dst`` was forked before (a restart).

    ``weights_only``: the step becomes ``dst``'s delta base, not a step of it
    (``fork(..., as_base=True)``): the run starts afresh on the source's weights (the caller
    loads them from the source) and its own checkpoints reference what did not change.

    Raises:
        ConfigError: ``dst`` holds checkpoints not forked from that source (or step), or a fork
            that never got its checkpoint, or a fork of the other kind (whole or weights only)
            where that changes what the run starts from.
        CheckpointNotFoundError: no such step in the source.
    """
    src, step = split_step(fork_from)
    target = open_location(dst, storage_options)
    links = read_links(target)
    has_steps = bool(target.list(mf.MANIFEST_DIR))
    if links is None and not has_steps:
        return CheckpointStore.fork(
            src,
            dst,
            step,
            storage_options=storage_options,
            src_storage_options=storage_options,
            pool_storage_options=storage_options,
            as_base=weights_only,
        )
    origin = links.forked_from if links is not None else None
    wanted = open_location(src, storage_options).url
    if not origin or origin.get("url") != wanted or step not in (None, origin.get("step")):
        found = (
            f"a fork of step {origin.get('step')} of {origin.get('url')}"
            if origin
            else "checkpoints that are no fork"
        )
        raise ConfigError(
            f"fork_from={fork_from!r} but {target.url} already holds {found}; use a new "
            "location for a new fork, or drop fork_from (or name that source) to resume this run"
        )
    as_base = bool(origin.get("as_base"))
    if as_base != weights_only and (weights_only or not has_steps):
        kinds = ("of the whole checkpoint", "of weights only")
        raise ConfigError(
            f"{target.url} is a fork {kinds[as_base]} of step {origin.get('step')} of "
            f"{origin.get('url')}, but this run asks for a fork {kinds[weights_only]}; use a "
            "new location for a new fork, or ask for the kind it is"
        )
    if not has_steps and not (as_base and target.exists(FORK_BASE)):
        raise ConfigError(
            f"{target.url} records a fork of {origin.get('url')} but holds no checkpoint (the fork "
            f"was interrupted); delete {target.url}, run `lightning-incremental unpin "
            f"{origin.get('url')} {target.url}`, and start again"
        )
    return None


def forked_weights(dst: str, key: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The top-level ``key`` (the model's weights) of the step ``dst`` was forked from, on the
    CPU: what a fork of weights only starts from. Read through ``dst``'s own copy of that step's
    manifest (its fork base), from where its objects lie now — so it loads after the source
    deleted the step, left its pool or was removed — or, when ``dst`` holds no fork base any
    more (``unpin --force``), from the source's step.

    Raises:
        ConfigError: ``dst`` records no fork.
        CheckpointNotFoundError: no fork base, and the source no longer holds the step.
    """
    links = read_links(open_location(dst, storage_options))
    origin = links.forked_from if links is not None else None
    if not origin:
        raise ConfigError(f"{dst} records no fork: drop fork_weights_only")
    with CheckpointStore(dst, storage_options=storage_options) as fork:
        if fork.storage.exists(FORK_BASE):
            return fork.load_fork_base(keys=key, map_location="cpu")[key]
    try:
        with CheckpointStore(origin["url"], storage_options=storage_options) as store:
            return store.load(origin["step"], keys=key, map_location="cpu")[key]
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{dst} holds no fork base any more (its pin was removed with force) and its source "
            f"no longer holds step {origin['step']}: {exc}. Start the run from other weights, "
            "or fork a step the source keeps into a new location"
        ) from exc
