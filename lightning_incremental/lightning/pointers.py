"""Pointer files: the small JSON files at Lightning's checkpoint paths, each naming one step of
the engine store next to it; and the few file operations they need, done through the
:class:`~lightning_incremental.core.storage.Storage` of the file's directory — so pointer files
work wherever a store does, and are written the way the store writes its objects (atomically;
on local disks fsynced, renamed into place, the directory fsynced). Framework-free: used by
:mod:`lightning_incremental.lightning.checkpoint_io`.

A pointer file::

    {"format": "lightning-incremental-pointer", "version": 1, "store": ".incremental",
     "step": 7, "id": "<32 hex digits>", "global_step": 400, "epoch": 3,
     "previous": 5, "previous_id": "<32 hex digits>"}

``store`` is one plain directory name, resolved against the pointer's own directory: a pointer
cannot name anything outside it. ``id`` is a random identifier that the checkpoint's manifest
records too (audit metadata ``checkpoint_id``), so that a pointer copied next to another run's
store, whose step numbers overlap, is detected instead of loading the wrong checkpoint.
``global_step`` and ``epoch`` repeat the checkpoint's own, for people and tools.

A pointer is written as soon as its save has been snapshotted, before the step commits (so that
the path exists when ``save_checkpoint`` returns, as Lightning's callbacks expect). ``previous``
and ``previous_id`` (optional, null when absent) name the step of the pointer it replaced: that
step is kept until the new one commits, and a reader that finds the named step never committed
(the writer crashed, or its save failed) falls back to it. Both fields are optional additions to
version 1: older pointers without them still parse, and older readers ignore them.

``writer`` (optional, null when absent) names the process that wrote the pointer (``host``,
``pid``): a reader that finds the step not committed tells "not committed yet, its writer is still
running" from "its writer died" by it.

The first bytes
---------------
Tools that expect a ``torch.save`` file (``torch.load``, ``LightningModule.load_from_checkpoint``)
open pointer files too. So a pointer file starts with :data:`HEADER`, a five-line pickle program
that only raises an error saying what the file is and how to load it, followed by the JSON
document::

    clightning_incremental._pointers
    not_a_torch_checkpoint
    (VThis file is a lightning-incremental pointer file, not a torch.save checkpoint: ...
    tR.{"format": "lightning-incremental-pointer", "version": 1, ...}

``torch.load(path)`` (``weights_only=True``) fails with "Unsupported global: GLOBAL
lightning_incremental._pointers.not_a_torch_checkpoint"; ``torch.load(path,
weights_only=False)`` raises :class:`NotATorchCheckpointError` with the message (or, without
this library installed, "No module named 'lightning_incremental'"). Nothing else runs. The
reader skips the header; files without it (the plain JSON object written by earlier versions)
still load. ``torch.save`` files start with a zip or a binary pickle header, so the two kinds
are told apart by their first bytes.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import posixpath
import re
import socket
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from lightning_incremental.core import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    StorageError,
)
from lightning_incremental.core.format.layout import loads_record
from lightning_incremental.core.storage import TMP_PREFIX, LocalStorage, Storage, open_storage

POINTER_FORMAT = "lightning-incremental-pointer"
POINTER_VERSION = 1
MAX_POINTER_BYTES = 64 * 1024
_STORE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
_TMP = re.compile(r"^\..*\.[0-9a-f]{32}\.li-tmp$")  # temporary files of earlier versions
_ID = re.compile(r"^[0-9a-f]{32}$")

HOW_TO_LOAD = (
    "This file is a lightning-incremental pointer file, not a torch.save checkpoint: it names a "
    "checkpoint in the incremental store next to it (the .incremental directory). Load it with "
    "lightning_incremental.load_from_checkpoint(MyModel, path) instead of "
    "MyModel.load_from_checkpoint(path), with IncrementalCheckpointIO().load_checkpoint(path), "
    "or with Trainer(plugins=[IncrementalCheckpointIO()]) and ckpt_path=path. For plain .ckpt "
    "files of the best and last checkpoints use IncrementalCheckpointIO(materialize=True); for "
    "any checkpoint, the command: lightning-incremental export."
)
#: The first bytes of every pointer file: a pickle program (protocol 0) calling
#: :func:`not_a_torch_checkpoint` with :data:`HOW_TO_LOAD`, so ``torch.load`` fails saying so.
#: The module named there is part of the format: files written by every version name
#: ``lightning_incremental._pointers``, which stays importable (it re-exports the function).
HEADER_MODULE = "lightning_incremental._pointers"
HEADER = f"c{HEADER_MODULE}\nnot_a_torch_checkpoint\n(V{HOW_TO_LOAD}\ntR.".encode("ascii")
_HEADER_START = HEADER[: HEADER.index(b"\n") + 1]  # "clightning_incremental._pointers\n"
_HEADER_END = b"\ntR."
HEAD_BYTES = 64  # enough of a file to tell a pointer from a torch.save file


class PointerError(CorruptCheckpointError):
    """A pointer file that is malformed, names a store outside its own directory, or names a
    checkpoint of another history."""


class NotATorchCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A pointer file was opened with ``torch.load`` (or ``pickle``), which cannot read it."""


def not_a_torch_checkpoint(message: str) -> None:
    """What unpickling a pointer file calls (see :data:`HEADER`): it only raises.

    Raises:
        NotATorchCheckpointError: always, with ``message`` (how to load the file).
    """
    raise NotATorchCheckpointError(message)


@dataclass(frozen=True)
class Writer:
    """The process that wrote a pointer file."""

    host: str
    pid: int

    @classmethod
    def this_process(cls) -> Writer:
        return cls(socket.gethostname(), os.getpid())

    def state(self) -> str:
        """``"this process"``, ``"running"``, ``"dead"`` or ``"unknown"`` (another host)."""
        if self.host != socket.gethostname():
            return "unknown"
        if self.pid == os.getpid():
            return "this process"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "dead"
        except OSError:  # exists, owned by another user
            return "running"
        return "running"

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}"


@dataclass(frozen=True)
class Pointer:
    """What a checkpoint file at a Lightning path holds: where its checkpoint is."""

    store: str
    step: int
    id: str | None = None  # also recorded in the checkpoint's manifest (audit metadata)
    global_step: int | None = None
    epoch: int | None = None
    previous: int | None = None  # the step of the pointer this one replaced, kept until commit
    previous_id: str | None = None
    writer: Writer | None = None  # the process that wrote it

    def dumps(self) -> bytes:
        body = {
            "format": POINTER_FORMAT,
            "version": POINTER_VERSION,
            "store": self.store,
            "step": self.step,
            "id": self.id,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "previous": self.previous,
            "previous_id": self.previous_id,
            "writer": None
            if self.writer is None
            else {"host": self.writer.host, "pid": self.writer.pid},
        }
        return HEADER + (json.dumps(body, indent=1) + "\n").encode()

    def why_uncommitted(self) -> str:
        """Why the step this pointer names is not committed, no save of this process being in
        flight: says whether its writer is still running, died, or cannot be checked. Finishes
        "<path> names step 7 of <store>, which ..."."""
        writer = self.writer
        if writer is None:  # written by an earlier version
            return (
                "never committed (the process saving it crashed, the save failed, or another "
                "process is still writing it)"
            )
        state = writer.state()
        if state == "this process":
            return (
                "never committed: this process wrote the file, so either its save failed (the "
                "error was reported then) or the file was copied or downloaded without its store"
            )
        if state == "running":
            return (
                f"is not committed yet: its writer, {writer.describe()}, is still running (still "
                "writing it, or hung); load it again once that process's save_checkpoint returned"
            )
        if state == "dead":
            return (
                f"never committed: its writer died ({writer.describe()} exited before the "
                "checkpoint committed)"
            )
        return (
            f"is not committed: either not yet ({writer.describe()} is still writing it) or never "
            "(that process died or its save failed); this host cannot tell which"
        )

    @classmethod
    def parse(cls, data: bytes, where: str) -> Pointer:
        """Raises: PointerError, FormatVersionError."""
        if len(data) > MAX_POINTER_BYTES:
            raise PointerError(
                f"{where} is not a valid pointer file: larger than {MAX_POINTER_BYTES}"
            )
        try:
            doc = loads_record(document(data).decode("utf-8"))
        except ValueError as exc:
            raise PointerError(f"{where} is not a valid pointer file: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
            raise PointerError(
                f"{where} is JSON but not a lightning-incremental pointer file (its 'format' is "
                f"not {POINTER_FORMAT!r})"
            )
        version = doc.get("version")
        if not is_int(version) or version < 1:
            raise PointerError(f"{where}: 'version' must be an int >= 1, got {version!r}")
        if version > POINTER_VERSION:
            raise FormatVersionError(
                f"{where} is pointer format version {version}, newer than this library reads "
                f"({POINTER_VERSION}); upgrade lightning-incremental"
            )
        store = doc.get("store")
        if not isinstance(store, str) or not valid_store_name(store):
            raise PointerError(
                f"{where} names the store {store!r}: a pointer may only name a store directory "
                "next to it (one plain path component, no '/', '..' or URL), so it cannot point "
                "outside its own directory"
            )
        step = doc.get("step")
        if not is_int(step) or step < 0:
            raise PointerError(f"{where}: 'step' must be an int >= 0, got {step!r}")
        ident = doc.get("id")
        if ident is not None and not (isinstance(ident, str) and _ID.match(ident)):
            raise PointerError(f"{where}: 'id' must be 32 hex digits or null, got {ident!r}")
        progress = {}
        for key in ("global_step", "epoch"):
            value = doc.get(key)
            if value is not None and not is_int(value):
                raise PointerError(f"{where}: {key!r} must be an int or null, got {value!r}")
            progress[key] = value
        previous = doc.get("previous")
        if previous is not None and not (is_int(previous) and previous >= 0):
            raise PointerError(f"{where}: 'previous' must be an int >= 0 or null, got {previous!r}")
        previous_id = doc.get("previous_id")
        if previous_id is not None and not (
            isinstance(previous_id, str) and _ID.match(previous_id)
        ):
            raise PointerError(
                f"{where}: 'previous_id' must be 32 hex digits or null, got {previous_id!r}"
            )
        writer = doc.get("writer")
        if writer is not None and not (
            isinstance(writer, dict)
            and isinstance(writer.get("host"), str)
            and is_int(writer.get("pid"))
        ):
            raise PointerError(
                f"{where}: 'writer' must be null or {{'host': str, 'pid': int}}, got {writer!r}"
            )
        return cls(
            store,
            step,
            ident,
            **progress,
            previous=previous,
            previous_id=previous_id,
            writer=None if writer is None else Writer(writer["host"], writer["pid"]),
        )


@dataclass(frozen=True)
class CheckpointFile:
    """A checkpoint path, as a name in the :class:`Storage` of its directory: on a local disk,
    or under any URL a store can be at (every backend of ``open_storage``)."""

    storage: Storage  # the file's directory
    name: str  # the file's name in it
    path: str  # local: the absolute path; otherwise the URL
    display: str  # as the user wrote it, less any credentials in a URL
    storage_options: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls, text: str, storage_options: dict[str, Any] | None, *, resolve: bool
    ) -> CheckpointFile:
        """The checkpoint file at ``text`` (a local path, ``file://`` or another URL).

        Raises:
            ValueError: ``text`` names a directory (ends with '/'), or cannot be opened.
        """
        if not text or text.endswith(("/", os.sep)):
            raise ValueError(f"a checkpoint path must name a file, got {text!r}")
        match = _SCHEME.match(text)
        if match is None or match.group(1).lower() == "file":
            local = text[len("file://") :] if match else text
            local = os.path.abspath(os.path.expanduser(local))
            if resolve:
                local = os.path.realpath(local)
            else:  # the file itself may be a link this call replaces; its directory is resolved
                local = os.path.join(
                    os.path.realpath(os.path.dirname(local)), os.path.basename(local)
                )
            directory, name = os.path.split(local)
            return cls(LocalStorage(directory), name, local, text)
        scheme = match.group(0)
        parent, _, name = text[len(scheme) :].rstrip("/").rpartition("/")
        try:
            storage = open_storage(scheme + parent, storage_options)
        except ConfigError as exc:  # its message names the problem, never an option's value
            raise ValueError(f"cannot open {_shown(text)}: {exc}") from None
        if isinstance(storage, LocalStorage):  # an fsspec URL of a local filesystem
            return cls.of(posixpath.join(storage.root, name), None, resolve=resolve)
        return cls(storage, name, f"{storage.url}/{name}", _shown(text), storage_options)

    @property
    def local(self) -> bool:
        return isinstance(self.storage, LocalStorage)

    @property
    def key(self) -> str:
        return self.path

    @property
    def path_url(self) -> str:
        return self.path

    @property
    def parts(self) -> list[str]:
        return self.path.replace(os.sep, "/").split("/")[:-1]

    def store_url(self, store_name: str) -> str:
        if self.local:
            return os.path.join(os.path.dirname(self.path), store_name)
        return f"{self.storage.url}/{store_name}"

    def isdir(self) -> bool:
        """Whether the path is a directory (a store's): on object stores, no object of that
        name but objects under it."""
        if self.local:
            return os.path.isdir(self.path)
        if self.head() is not None:
            return False
        return open_storage(self.path, self.storage_options).exists("")

    def islink(self) -> bool:
        return self.local and os.path.islink(self.path)

    def head(self) -> bytes | None:
        """The first bytes of the file; None when there is no file."""
        return _read(self.storage, self.name, HEAD_BYTES)

    def read(self) -> bytes:
        """The file's bytes, up to one more than a pointer file may have.

        Raises:
            FileNotFoundError: there is no file.
            StorageError: it cannot be read.
        """
        return self.storage.get(self.name, 0, MAX_POINTER_BYTES + 1)

    def remove(self) -> None:
        self.storage.delete(self.name)

    def makedirs(self) -> None:
        """Create the file's directory on a local disk (ModelCheckpoint links into it right
        after a save). Elsewhere the write creates what it needs: buckets have no directories,
        and creating one could create a mistyped bucket."""
        if self.local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def write_atomic(self, data: bytes, *, fsync: bool) -> None:
        """Replace the file by ``data`` atomically, as the store writes its objects (on local
        disks: a temporary file, fsynced when ``fsync``, renamed into place, the directory
        fsynced).

        Raises:
            StorageError, FileNotFoundError: the write failed; the file is as it was.
        """
        if isinstance(self.storage, LocalStorage):
            self.storage.fsync = fsync
        self.storage.put(self.name, data, overwrite=True)

    def sibling_pointers(self) -> set[tuple[str, int]]:
        """(store, step) named by every readable pointer file in this file's directory."""
        return {(pointer.store, pointer.step) for pointer in self.siblings()}

    def siblings(self) -> list[Pointer]:
        """Every readable pointer file in this file's directory (this one included).

        Raises:
            StorageError: a file that cannot be read (it may name the step the caller is about
                to release: releasing must stop rather than guess).
        """
        found: list[Pointer] = []
        for name in self.storage.listdir(""):
            if name.startswith(TMP_PREFIX) or _TMP.match(name):
                continue  # a pointer write that never completed names nothing
            data = _read(self.storage, name, MAX_POINTER_BYTES + 1)
            if data is None or len(data) > MAX_POINTER_BYTES:
                continue  # dangling links, files vanishing meanwhile, torch.save files
            if looks_like_pointer(data):
                try:
                    found.append(Pointer.parse(data, name))
                except CheckpointError:
                    continue  # other JSON files
        return found


def _read(storage: Storage, name: str, limit: int) -> bytes | None:
    """Up to ``limit`` first bytes of ``name``; None when there is no such file (or it is a
    directory)."""
    try:
        return storage.get(name, 0, limit)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except StorageError as exc:
        if exc.errno in (errno.EISDIR, errno.ENOTDIR):
            return None
        raise


def looks_like_pointer(head: bytes) -> bool:
    """Pointer files start with :data:`HEADER` (or, written by earlier versions, are a JSON
    object); torch.save files start with a zip or binary pickle header. ``head``: at least
    :data:`HEAD_BYTES` bytes of the file (or all of it)."""
    return head.startswith(_HEADER_START) or head.lstrip()[:1] == b"{"


def document(data: bytes) -> bytes:
    """The JSON document of a pointer file: ``data`` without its :data:`HEADER`.

    Raises:
        PointerError: the header is not terminated.
    """
    if not data.startswith(_HEADER_START):
        return data  # written by an earlier version: JSON only
    end = data.find(_HEADER_END)
    if end < 0:
        raise PointerError("a pointer file whose header is cut off (a truncated copy?)")
    return data[end + len(_HEADER_END) :]


def valid_store_name(name: str) -> bool:
    return bool(_STORE_NAME.match(name)) and name not in (".", "..") and ".." not in name


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


_CREDENTIALS = re.compile(r"(?<=://)[^/@]+@")


def _shown(url: str) -> str:
    """``url`` for messages and manifests: ``user:password@`` in it replaced."""
    return _CREDENTIALS.sub("<credentials>@", url)
