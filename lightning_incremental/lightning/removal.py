"""What :class:`~.checkpoint_io.IncrementalCheckpointIO`'s ``remove_checkpoint`` deletes, and
which stores the plug-in closes as soon as a read or a removal is done.

Removing a pointer file releases its step (:func:`~.pointer_lifecycle.removed`): the step's
manifest is deleted, then every object that no remaining checkpoint needs, by the engine's
retention rules (:mod:`lightning_incremental.core.maintain.retention`): objects younger than
``min_object_age_s`` (default 900 s) stay, since a save of another writer in flight may name
them, and are swept by a later removal. Removing the newest checkpoint, the next save's delta
base, deletes its objects too when no save is pending.

When the removed file was the last pointer file naming its store and the store holds no other
checkpoint, the store directory itself is deleted (young objects included: no checkpoint can
name them any more), so a directory whose checkpoints were all removed holds nothing of ours —
as ``TorchCheckpointIO`` leaves it. Only for a store this process does not save to (the main
process of ``ddp_spawn``, a script removing checkpoints after ``fit``): a store this process is
saving to stays open for its next save. A store that holds pins (``pins/``: forks reference its
objects, which stay until each fork is unpinned) is kept.

Stores this process only reads or removes from (``ddp_spawn``'s main process loads the weights
its rank 0 saved and removes them, and never calls ``teardown``) are closed when the call
returns: their threads end and their writer lease is released.
"""

from __future__ import annotations

import logging
import shutil
import threading

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_incremental.core import CheckpointError
from lightning_incremental.core.maintain.pins import PIN_DIR
from lightning_incremental.core.storage import LocalStorage, open_storage
from lightning_incremental.lightning.pointer_lifecycle import OpenStore, removed
from lightning_incremental.lightning.pointers import CheckpointFile, Pointer, looks_like_pointer

log = logging.getLogger(__name__)


def take_pointer(target: CheckpointFile) -> Pointer | None:
    """Delete the checkpoint file at ``target``; return its pointer when it was a valid pointer
    file. A symbolic link is only unlinked, a plain ``torch.save`` file removed as
    ``TorchCheckpointIO`` would."""
    if target.islink():
        target.remove()
        return None
    head = target.head()
    if head is None:
        return None
    if not looks_like_pointer(head):
        TorchCheckpointIO().remove_checkpoint(target.path)
        return None
    try:
        pointer: Pointer | None = Pointer.parse(target.read(), target.display)
    except CheckpointError as exc:
        log.warning("removing %s, which is not a valid pointer file: %s", target.display, exc)
        pointer = None
    target.remove()
    return pointer


def remove_step(target: CheckpointFile, entry: OpenStore, pointer: Pointer, *, last: bool) -> None:
    """Release the step of the removed ``pointer`` (and its ``previous``); with ``last`` (a
    store this process does not save to, closed after this), delete the store directory when
    no pointer file names the store any more and it holds no checkpoint."""
    removed(target, entry, pointer)
    if not last or entry.store.steps():
        return
    if any(p.store == pointer.store for p in target.siblings()):
        return
    entry.store.close()  # releases the writer lease: nothing may write there any more
    drop_store(entry.store_url, target)


def forked(url: str, target: CheckpointFile) -> bool:
    """Whether the store at ``url`` holds pins (forks reference its objects, whatever becomes
    of its checkpoints); one listing. A listing that fails counts as holding some."""
    try:
        return bool(open_storage(url, target.storage_options).list(PIN_DIR))
    except (OSError, CheckpointError) as exc:
        log.warning("keeping the store %s: its pins cannot be listed (%s)", url, exc)
        return True


def drop_store(url: str, target: CheckpointFile) -> None:
    """Delete the (empty of checkpoints) store directory at ``url``, unless it holds pins;
    best effort."""
    if forked(url, target):
        log.info(
            "keeping the store %s although it holds no checkpoint: forks reference its objects "
            "(%s/); it can be deleted once each fork is unpinned",
            url,
            PIN_DIR,
        )
        return
    try:
        storage = open_storage(url, target.storage_options)
        if isinstance(storage, LocalStorage):
            shutil.rmtree(storage.root, ignore_errors=False)
            return
        for name in storage.list(""):
            storage.delete(name)
    except (OSError, CheckpointError) as exc:
        log.warning("could not delete the empty store %s: %s", url, exc)


def close_unsaved(lock: threading.Lock, stores: dict[str, OpenStore]) -> None:
    """Close and forget the stores of ``stores`` this process did not save to."""
    with lock:
        idle = [entry for entry in stores.values() if not entry.saves]
        for entry in idle:
            del stores[entry.store_url]
    for entry in idle:
        entry.store.close()
