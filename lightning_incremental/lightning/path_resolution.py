"""Which checkpoint a path given to :class:`~.checkpoint_io.IncrementalCheckpointIO` means: a
plain ``torch.save`` file, a store directory (its newest checkpoint), or the step of a store that
a pointer file names (or the step it replaced, when that one never committed).

``load_checkpoint(path)`` reads the pointer, validates it (format, version, a store name that
cannot leave the directory, an id that the step's manifest must record) and returns the complete
checkpoint dict with bit-identical tensors. Under DDP (``torch.distributed`` initialised with
more than one process) ``load_checkpoint`` is *collective*, as ``torch.distributed.checkpoint``'s
load is: every rank must call it (Lightning's strategies do). Only global rank 0 saves, so only
it knows which saves are in flight: it waits for them, resolves what the path means (with the
fallback above) and broadcasts that, so every rank loads the same step or raises the same
error. A path that is a plain ``torch.save`` file (no
pointer) is loaded by Lightning's ``TorchCheckpointIO``, so runs can resume from checkpoints
written before this plug-in was added. A path that is a store directory loads its newest
committed checkpoint.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    PickleNotAllowedError,
)
from lightning_incremental.core.save import inflight
from lightning_incremental.lightning.compat import PathLike
from lightning_incremental.lightning.hparams import typed_hyperparameters
from lightning_incremental.lightning.pointers import (
    CheckpointFile,
    Pointer,
    PointerError,
    looks_like_pointer,
)

log = logging.getLogger(__name__)


class _TorchIODefault:
    """``load_checkpoint``'s default ``map_location``: every tensor on the CPU, as
    ``TorchCheckpointIO``'s default (``lambda storage, loc: storage``). An explicit ``None``
    means what it means to ``torch.load``: the device each tensor was saved on."""

    def __repr__(self) -> str:
        return "<cpu: TorchCheckpointIO's default>"


#: ``load_checkpoint``'s default ``map_location`` (see :class:`_TorchIODefault`).
TO_CPU: Any = _TorchIODefault()


def to_cpu(storage: Any, location: str) -> Any:
    """``TorchCheckpointIO``'s default ``map_location``: every storage stays where it was
    loaded, on the CPU."""
    return storage


class Plan(NamedTuple):
    """What a load reads: a plain ``torch.save`` file, or one step of a store (None: its
    newest). Rank 0 broadcasts it under DDP, so it holds only plain values."""

    kind: str  # "torch" or "store"
    location: str  # the file's local path, or the store's URL
    step: int | None
    display: str  # the path as the user wrote it, for messages


def resolve(
    path: PathLike,
    file_of: Callable[[PathLike], CheckpointFile],
    store_of: Callable[[str], CheckpointStore],
) -> Plan:
    """What loading ``path`` means, once no save of this process to its store is in flight
    (whichever plug-in instance started it). ``file_of``: the file at a path (links resolved);
    ``store_of``: the open store at a URL.

    Raises:
        FileNotFoundError, CheckpointError: as ``IncrementalCheckpointIO.load_checkpoint``.
    """
    while True:
        source = file_of(path)
        if source.isdir():
            if inflight.wait(source.path_url):
                continue
            return Plan("store", source.path_url, None, source.display)
        head = source.head()
        if head is None:
            raise FileNotFoundError(f"Checkpoint file not found: {source.display}")
        if not looks_like_pointer(head):
            return Plan("torch", source.path, None, source.display)
        pointer = Pointer.parse(source.read(), source.display)
        url = source.store_url(pointer.store)
        # A save of this process to that store (this Trainer's or another's) commits first;
        # then the file is read again: a failed save puts the file it replaced back.
        if not inflight.wait(url):
            break
    try:
        check_step(store_of, url, pointer.step, pointer.id, pointer.store, source.display)
        return Plan("store", url, pointer.step, source.display)
    except CheckpointNotFoundError as exc:
        missing = exc
    # The step the pointer names is not committed, and no save of this process is writing
    # it: another process is still writing it, or its writer died or failed.
    why = pointer.why_uncommitted()
    if pointer.previous is not None:
        try:
            check_step(
                store_of, url, pointer.previous, pointer.previous_id, pointer.store, source.display
            )
        except CheckpointNotFoundError:
            pass
        else:
            message = (
                f"{source.display} names step {pointer.step} of {url}, which {why}; loading "
                f"the checkpoint that file held before, step {pointer.previous}, instead"
            )
            log.warning(message)
            warnings.warn(message, UserWarning, stacklevel=4)
            return Plan("store", url, pointer.previous, source.display)
    also = (
        f"; the checkpoint it replaced (step {pointer.previous}) is not committed either"
        if pointer.previous is not None
        else ""
    )
    raise rewrap(
        missing,
        f"cannot load {source.display} (step {pointer.step} of {url}): {missing}; that step "
        f"{why}, or its store was moved or deleted{also}",
    ) from missing


def check_step(
    store_of: Callable[[str], CheckpointStore],
    url: str,
    step: int,
    ident: str | None,
    store_name: str,
    display: str,
) -> None:
    """``step`` is committed, and (with an id) is the checkpoint the pointer names: step
    numbers of different stores overlap, and a pointer copied next to another store would
    load the wrong checkpoint.

    Raises:
        CheckpointNotFoundError: the step is not committed (or there is no store).
        PointerError: another checkpoint. CheckpointError: the step cannot be read.
    """
    try:
        manifest = store_of(url).manifest(step)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as exc:
        raise rewrap(exc, f"cannot load {display} (step {step} of {url}): {exc}") from exc
    if ident is None:
        return
    audit = manifest.audit
    metadata = audit.get("metadata")
    recorded = metadata.get("checkpoint_id") if isinstance(metadata, dict) else None
    if recorded != ident:
        raise PointerError(
            f"{display} names step {step} of {url}, but that step is another "
            f"checkpoint (id {recorded}, not {ident}): the pointer file was copied "
            "from another checkpoint directory or run; copy a checkpoint directory whole, "
            f"with its {store_name} store"
        )


def load_from_store(
    plan: Plan,
    location: Any,
    weights_only: bool | None,
    *,
    store_of: Callable[[str], CheckpointStore],
    open_reader: Callable[[str], CheckpointStore],
    allow_pickle: bool,
) -> tuple[dict[str, Any], int | None]:
    """The checkpoint a store ``plan`` names, and its step. ``store_of``: the open store at a
    URL; ``open_reader``: a one-off store that refuses pickles (for ``weights_only`` with
    ``allow_pickle``).

    Raises:
        PickleNotAllowedError: the checkpoint holds pickles and they are not allowed.
        CheckpointError: the checkpoint cannot be loaded (naming the path).
    """
    url, step, display = plan.location, plan.step, plan.display
    what = f"step {step} of {url}" if step is not None else f"the newest checkpoint of {url}"
    try:
        if weights_only and allow_pickle:  # a one-off reader that refuses pickles
            with open_reader(url) as reader:
                loaded, at = reader.load(step, map_location=location), reader.loaded_step
        else:
            store = store_of(url)
            loaded, at = store.load(step, map_location=location), store.loaded_step
        return typed_hyperparameters(loaded), at
    except PickleNotAllowedError as exc:
        hint = (
            "it was loaded with weights_only=True"
            if allow_pickle
            else "construct IncrementalCheckpointIO(allow_pickle=True) to load it"
        )
        raise PickleNotAllowedError(
            f"cannot load {display} ({what}): {exc}; {hint}, only if you trust it"
        ) from exc
    except CheckpointError as exc:
        raise rewrap(exc, f"cannot load {display} ({what}): {exc}") from exc


def rewrap(exc: CheckpointError, message: str) -> CheckpointError:
    """The same kind of error, with the Lightning path it was about."""
    try:
        return type(exc)(message)
    except TypeError:
        return CheckpointError(message)
