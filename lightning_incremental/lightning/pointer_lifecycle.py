"""The pointer files of :class:`~.checkpoint_io.IncrementalCheckpointIO` beside each store:
which step a new one names, what it replaces, and when a step it no longer names is released.

Lightning addresses checkpoints by file path and finds them by listing directories (``"last"``
is the newest ``last*.ckpt`` file, ``best_model_path`` is a path, every ``fit/validate/test/
predict(ckpt_path=...)`` checks that the file exists). So each path stays a real file:

- every directory that checkpoints are saved to holds one engine store, in the hidden
  sub-directory ``<dir>/.incremental`` (``store_name``);
- each save becomes the next step of that store: steps are a sequence number (0, 1, 2, ...),
  not the global step, because ModelCheckpoint saves the same global step under several names
  (a top-k file and ``last.ckpt``); the second save costs a manifest, since nothing changed;
- at the path Lightning asked for, a small *pointer file* names the store (relative to the
  pointer's own directory, so a checkpoint directory can be moved or copied whole) and the step:
  a short header that makes ``torch.load`` fail saying what the file is and how to load it
  (:mod:`lightning_incremental.lightning.pointers`), then the JSON document::

      {"format": "lightning-incremental-pointer", "version": 1, "store": ".incremental",
       "step": 7, "id": "<32 hex digits>", "global_step": 400, "epoch": 3,
       "previous": 5, "previous_id": "<32 hex digits>", "writer": {"host": ..., "pid": ...}}

  It is written by ``save_checkpoint`` itself, as soon as the engine has snapshotted the state
  and before the step commits, atomically (a temporary file renamed into place on local disks,
  one PUT on object stores): Lightning's callbacks expect the file right after the save
  (ModelCheckpoint's ``-v1`` version counter, ``save_last="link"``). ``previous`` names the step
  of the pointer it replaced (the same path's older checkpoint); that step is kept until the
  new one commits, and released only then.
- a pointer whose step has not committed is *pending*. Loading it waits for the save when this
  process is making it, through this plug-in instance or another (a second ``Trainer``): every
  save is registered in :mod:`lightning_incremental.core.save.inflight` under its store. Otherwise
  another process is still writing it (its ``writer`` is alive), or the save never committed
  (its writer died between the pointer and the commit, or the save failed): the load falls back
  to ``previous`` when that is committed, with a warning naming both steps and which case it
  is, and else raises ``CheckpointNotFoundError`` saying so. A save that fails in the
  background also puts the replaced pointer file back (or removes its own, when it replaced
  none).

``remove_checkpoint(path)`` (top-k rotation, replaced ``last`` files) deletes the pointer file,
then the step, unless another pointer file in the directory names the same step (a ``last.ckpt``
copy) or names it as the ``previous`` of a pending step. Overwriting a pointer (ModelCheckpoint
rewrites ``last.ckpt``) releases the old step the same way, once the new one committed. The
engine deletes a step's objects only when no remaining checkpoint needs them, so a removal never
breaks a kept checkpoint (what it deletes, and when the store directory goes too:
:mod:`~.removal`).
"""

from __future__ import annotations

import copy
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    SaveHandle,
    UnsupportedValueError,
)
from lightning_incremental.lightning.hparams import plain_hyperparameters
from lightning_incremental.lightning.path_resolution import rewrap
from lightning_incremental.lightning.pointers import (
    CheckpointFile,
    Pointer,
    Writer,
    is_int,
    looks_like_pointer,
)
from lightning_incremental.runtime.cluster import writing
from lightning_incremental.runtime.policy.failures import FailurePolicy, describe

log = logging.getLogger(__name__)
# The plug-in's own logger: what it reports of a save keeps that logger's name.
_plugin_log = logging.getLogger("lightning_incremental.lightning.checkpoint_io")


class OpenStore:
    """One directory's store, the lock that orders saves against deletes, the next step."""

    def __init__(self, store: CheckpointStore, store_url: str) -> None:
        self.store = store
        self.store_url = store_url  # as the plug-in names it (what loads wait for)
        self.lock = threading.Lock()
        self.reserved: int | None = None
        self.saving: deque[Future[None]] = deque()  # this store's saves, oldest first
        self.inflight: set[int] = set()  # steps this process is saving, not committed yet
        self.saves = False  # this process saved to it (else: opened to read or remove only)

    def start_saving(self) -> None:
        """Before this process's first save into the store (the plug-in's start there, every
        ``fit`` anew: ``teardown`` closes the stores): check that it can write it, taking the
        writer lease (:mod:`lightning_incremental.runtime.cluster.writing`). Until that succeeds the
        store counts as opened to read only.

        Raises:
            WriterLeaseError: another job writes the store (naming its host, pid and job).
            StoreNotWritableError: the store cannot be written.
        """
        if not self.saves:
            writing.begin(self.store, claim=False)
            self.saves = True

    def next_step(self, pointers: Callable[[], set[tuple[str, int]]], store_name: str) -> int:
        """After every committed step and every step a pointer file names (a step deleted
        from the store is not reused while a stale pointer might still name it)."""
        if self.reserved is None:
            named = [step for store, step in pointers() if store == store_name]
            self.reserved = max([-1, *self.store.steps(), *named]) + 1
        return self.reserved

    def finish_unnamed(self, handle: Any, step: int) -> None:
        """Wait for a save whose pointer file could not be written (it commits unnamed)."""
        try:
            handle.wait()
        finally:
            self.inflight.discard(step)


def replaced(
    target: CheckpointFile, entry: OpenStore, store_name: str
) -> tuple[bytes | None, tuple[int, str | None] | None]:
    """The pointer file at ``target`` that a save replaces (its bytes, to put back if the save
    fails) and the (step, id) the new pointer keeps as ``previous``: the old pointer's step, or,
    when that save never committed and is not in flight here, its own previous."""
    if target.islink():
        return None, None
    head = target.head()
    if head is None or not looks_like_pointer(head):
        return None, None
    data = target.read()
    try:
        old = Pointer.parse(data, target.display)
    except CheckpointError:
        return None, None
    if old.store != store_name:
        return None, None
    if old.step in entry.inflight or old.step in entry.store.steps():
        return data, (old.step, old.id)
    if old.previous is None:
        return data, None
    return data, (old.previous, old.previous_id)


def restore(target: CheckpointFile, pointer: Pointer, old: bytes | None, *, fsync: bool) -> None:
    """After a failed save: put back the pointer file it replaced (or remove it), unless the
    file was replaced meanwhile. Best effort: a reader falls back to ``previous``."""
    try:
        head = target.head()
        if head is None or not looks_like_pointer(head) or target.islink():
            return
        if Pointer.parse(target.read(), target.display) != pointer:
            return
        if old is None:
            target.remove()
        else:
            target.write_atomic(old, fsync=fsync)
    except Exception as exc:
        log.warning("could not restore %s after its save failed: %s", target.display, exc)


def committed(target: CheckpointFile, entry: OpenStore, pointer: Pointer) -> None:
    """After the commit: release the step the pointer replaced, never before."""
    if pointer.previous is not None and pointer.previous != pointer.step:
        release(target, entry, pointer.store, pointer.previous)


def finisher(
    handle: SaveHandle,
    target: CheckpointFile,
    entry: OpenStore,
    pointer: Pointer,
    old: bytes | None,
    restore: Callable[[CheckpointFile, Pointer, bytes | None], None],
    failures: FailurePolicy,
) -> tuple[Callable[[], None], list[BaseException]]:
    """The background job that ends the save of ``pointer`` at ``target`` (which replaced the
    bytes ``old``), and the list that job puts the save's failure in. The job waits for the
    commit; then it releases the step the pointer replaced (:func:`committed`), or, when the
    save failed, puts the old pointer back (``restore``) and records the failure in
    ``failures`` (reported by the plug-in's next call, as the policy says)."""
    step = pointer.step
    failure: list[BaseException] = []

    def finish() -> None:
        try:
            handle.wait()
        except BaseException as exc:  # reported by the next call, as the policy says
            entry.inflight.discard(step)
            restore(target, pointer, old)
            _plugin_log.error("IncrementalCheckpointIO: saving %s failed: %s", target.display, exc)
            failure.append(exc)
            failures.failed(f"{target.display} (step {step} of {entry.store.url})", exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: not a storage failure to count
            return
        entry.inflight.discard(step)
        failures.committed()
        committed(target, entry, pointer)

    return finish, failure


def finish_now(
    job: Future[None],
    failure: list[BaseException],
    what: str,
    failures: FailurePolicy,
    close: Callable[[], None],
) -> None:
    """``Trainer.save_checkpoint`` outside of a running stage: wait for the save's ``job`` (from
    :func:`finisher`), raise its ``failure``, and end the threads (``close``: nothing else runs
    until the next stage or call). ``what`` names the file and the step in the error.

    Raises:
        CheckpointError: the save failed to commit.
    """
    job.exception()
    if not failure:
        close()
        return
    exc = failure[0]
    failures.take()  # reported here, by raising
    try:
        close()
    except Exception as other:
        _plugin_log.error("another checkpoint error while closing: %r", other)
    message = (
        f"saving {what} did not commit: {describe(exc)}; the file keeps naming the checkpoint it "
        "named before, if any"
    )
    if isinstance(exc, CheckpointError):
        raise rewrap(exc, message) from exc
    raise CheckpointError(message) from exc


def removed(target: CheckpointFile, entry: OpenStore, pointer: Pointer) -> None:
    """After the pointer file at ``target`` was removed: release its step, and its
    ``previous`` (kept when that save never committed)."""
    release(target, entry, pointer.store, pointer.step)
    if pointer.previous is not None:
        release(target, entry, pointer.store, pointer.previous)


def release(target: CheckpointFile, entry: OpenStore, store_name: str, step: int) -> None:
    """Delete ``step`` unless a pointer file next to ``target`` still names it, as its step or
    as the ``previous`` of a step that has not committed (its fallback)."""
    try:
        siblings = [p for p in target.siblings() if p.store == store_name]
    except OSError as exc:  # cannot tell what still names it: keeping it is the safe side
        log.warning(
            "keeping step %d of %s: the pointer files next to %s could not be "
            "read (%s); the step stays in the store (it costs space, nothing is lost)",
            step,
            store_name,
            target.display,
            exc,
        )
        return
    named = {p.step for p in siblings}
    fallbacks = [p for p in siblings if p.previous == step and p.step != step]
    if fallbacks and step not in named:
        steps = set(entry.store.steps())
        if any(p.step not in steps for p in fallbacks):
            named.add(step)
    if step in named:
        log.debug("keeping step %d of %s: another pointer file names it", step, store_name)
        return
    with entry.lock:  # no save may start while the engine deletes unreferenced objects
        try:
            entry.store.delete(step)
        except CheckpointNotFoundError:
            log.debug("step %d of %s was already deleted", step, entry.store.url)


def snapshot(
    checkpoint: dict[str, Any], target: CheckpointFile, entry: OpenStore, store_name: str
) -> tuple[Pointer, SaveHandle]:
    """Snapshot ``checkpoint`` as the store's next step (the engine's ``save``: it commits in
    the background) and return the pointer that names it (no ``previous`` yet) and the handle.

    OmegaConf hyper-parameters are saved as plain containers, as the callback saves them (see
    :mod:`~.hparams`; the caller's dict is not changed).

    Raises:
        UnsupportedValueError: a value that needs pickle, without ``allow_pickle``.
    """
    checkpoint = plain_hyperparameters(copy.copy(checkpoint))  # a shallow copy, same type
    with entry.lock:
        step = entry.next_step(lambda: target.sibling_pointers(), store_name)
        progress = _progress(checkpoint)
        pointer = Pointer(
            store_name,
            step,
            uuid.uuid4().hex,
            global_step=progress["global_step"],
            epoch=progress["epoch"],
            writer=Writer.this_process(),
        )
        try:
            handle = entry.store.save(
                checkpoint,
                step,
                metadata={
                    "path": target.display,
                    "checkpoint_id": pointer.id,
                    "global_step": pointer.global_step,
                    "epoch": pointer.epoch,
                },
            )
        except UnsupportedValueError as exc:
            raise UnsupportedValueError(
                f"cannot save checkpoint {target.display}: {exc}\n"
                "With IncrementalCheckpointIO: make the value plain data (for "
                "hyper-parameters, e.g. self.save_hyperparameters(vars(args)) or "
                "save_hyperparameters(ignore=[...])), or construct "
                "IncrementalCheckpointIO(allow_pickle=True) if every reader trusts these "
                "checkpoints."
            ) from exc
        entry.reserved = step + 1
        entry.inflight.add(step)
    return pointer, handle


def _progress(checkpoint: Any) -> dict[str, int | None]:
    """The checkpoint's global step and epoch, when it records them as ints."""
    out: dict[str, int | None] = {}
    for key in ("global_step", "epoch"):
        value = checkpoint.get(key) if isinstance(checkpoint, dict) else None
        out[key] = value if is_int(value) else None
    return out
