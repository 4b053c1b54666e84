"""The store's layout and audit trail: where manifests, packs and the store marker live, and
what a manifest records about its writer. The manifest's records are
:mod:`.format.records`."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import socket
from typing import Any

import torch

from lightning_incremental._version import __version__
from lightning_incremental.core.errors import (
    FormatVersionError,
    ManifestError,
    UnsupportedValueError,
)

FORMAT = "lightning-incremental"
LAYOUT = 1  # version of the store layout (the marker records it)
MANIFEST_DIR = "manifests"
PACK_DIR = "packs"
QUARANTINE_DIR = "quarantine"
MARKER = "store.json"
MAX_STEP = 10**20 - 1  # manifest names hold 20 digits
MAX_CHUNK_SIZE = 1 << 30  # as StoreConfig's bound: no larger chunk is ever written

_PACK = re.compile(rf"^{PACK_DIR}/[0-9a-f]{{2}}/[0-9a-f]{{32}}\.pack$")
_MANIFEST_NAME = re.compile(r"^(\d{20})(?:\.c(\d{10,}))?\.json$")


def manifest_path(step: int, compaction: int | None = None) -> str:
    """Where the manifest of ``step`` lies: the commit's (``compaction`` None), or the full base
    that a writer of generation ``compaction`` rewrote it as (see
    :mod:`~lightning_incremental.core.commit.versions`)."""
    if compaction is None:
        return f"{MANIFEST_DIR}/{step:020d}.json"
    return f"{MANIFEST_DIR}/{step:020d}.c{compaction:010d}.json"


def manifest_name(name: str) -> tuple[int, int | None] | None:
    """The step and compaction generation (None: the commit's own) of a manifest file name;
    None for anything else (temporary files included)."""
    match = _MANIFEST_NAME.match(name)
    if not match:
        return None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def step_of(name: str) -> int | None:
    """The step of a manifest file name, None for anything else (temporary files included)."""
    parsed = manifest_name(name)
    return None if parsed is None else parsed[0]


def pack_path(digest: str) -> str:
    return f"{PACK_DIR}/{digest[:2]}/{digest}.pack"


def is_pack_path(path: str) -> bool:
    return bool(_PACK.match(path))


def loads_record(data: bytes | bytearray | str) -> Any:
    """The JSON value of a small record read from storage (a marker, lease, fence, pin or pool
    record). Whatever the bytes hold, the error is a ``ValueError``: JSON nested deeper than
    the parser goes (``RecursionError``) included, which its callers then treat as any record
    that is not JSON.

    Raises:
        ValueError: not JSON (``UnicodeDecodeError`` for bytes that are not UTF-8).
    """
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply to be a record of this library") from exc


def marker_bytes() -> bytes:
    return json.dumps({"format": FORMAT, "layout": LAYOUT}).encode()


def check_marker(data: bytes, where: str) -> None:
    try:
        marker = loads_record(data)
    except ValueError as exc:
        raise ManifestError(f"store marker {where} is not JSON: {exc}") from exc
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a {FORMAT} store marker")
    layout = marker.get("layout")
    if not isinstance(layout, int) or layout > LAYOUT:
        raise FormatVersionError(
            f"{where} has layout version {layout!r}; this lightning-incremental reads up to "
            f"{LAYOUT} — upgrade lightning-incremental to read this store"
        )


def plain_json(value: Any, name: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of plain JSON values, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"{name} must hold plain JSON values only: {exc}") from exc


@functools.lru_cache(maxsize=1)
def code_version() -> str | None:
    """The git commit checked out where the training code runs (the working directory's
    repository), read from ``.git`` without running git; None outside a repository."""
    directory = os.path.abspath(os.getcwd())
    while True:
        git = os.path.join(directory, ".git")
        if os.path.isdir(git):
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent
    try:
        with open(os.path.join(git, "HEAD")) as fh:
            head = fh.read().strip()
        if not head.startswith("ref: "):
            return head if _COMMIT.match(head) else None
        ref = head[5:]
        ref_file = os.path.join(git, *ref.split("/"))
        if os.path.isfile(ref_file):
            with open(ref_file) as fh:
                commit = fh.read().strip()
            return commit if _COMMIT.match(commit) else None
        with open(os.path.join(git, "packed-refs")) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref and _COMMIT.match(parts[0]):
                    return parts[0]
    except OSError:
        return None
    return None


_COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")


def audit_record(meta: dict[str, Any] | None, world_size: int = 1) -> dict[str, Any]:
    """Who, where and with what a checkpoint was written, plus the caller's metadata."""
    return {
        "code_commit": code_version(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning_incremental": __version__,
        "world_size": world_size,
        "metadata": meta or {},
    }
