"""Manifests: the JSON commit record of one checkpoint, and its validation.

A manifest is self-contained: its ``chunks`` table holds the recipe of every chunk needed to
restore the checkpoint, including the bases of XOR deltas, so restore reads one manifest and
garbage collection knows every live object from the kept manifests alone.

Recipe of a chunk (keyed by the XXH3-128 of its raw bytes)::

    {"pack": "packs/ab/<32 hex>.pack", "offset": int, "length": int,  # its encoded bytes
     "size": int, "width": int, "kind": "z" | "x",  # raw size, byte-group width, encoding
     "base": "<32 hex>" | null, "depth": int, "chain": int}  # XOR base, chain length and bytes

The manifest carries an XXH3-128 checksum of its own canonical JSON, so a flipped bit in a shape
or a plain value is detected like a flipped bit in tensor data.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import socket
from typing import Any

import numpy as np
import torch

from lightning_incremental._version import __version__
from lightning_incremental.core.codec import HASH_LEN, KIND_FULL, KIND_XOR, chunk_hash
from lightning_incremental.core.errors import (
    FormatVersionError,
    ManifestError,
    UnsupportedValueError,
)
from lightning_incremental.core.tree import torch_dtype

FORMAT = "lightning-incremental"
VERSION = 1
MANIFEST_DIR = "manifests"
PACK_DIR = "packs"
QUARANTINE_DIR = "quarantine"
MARKER = "store.json"
MAX_STEP = 10**20 - 1  # manifest names hold 20 digits
MAX_CHUNK_SIZE = 1 << 30  # as StoreConfig's bound: no larger chunk is ever written

_HASH = re.compile(rf"^[0-9a-f]{{{HASH_LEN}}}$")
_PACK = re.compile(rf"^{PACK_DIR}/[0-9a-f]{{2}}/[0-9a-f]{{{HASH_LEN}}}\.pack$")
_MANIFEST_NAME = re.compile(r"^(\d{20})\.json$")
_REQUIRED = {
    "format": str,
    "version": int,
    "step": int,
    "generation": int,
    "since_base": int,
    "chunk_size": int,
    "created": str,
    "audit": dict,
    "stats": dict,
    "pickled": list,
    "tensors": list,
    "chunks": dict,
    "packs": dict,
}


def manifest_path(step: int) -> str:
    return f"{MANIFEST_DIR}/{step:020d}.json"


def step_of(name: str) -> int | None:
    """The step of a manifest file name, None for anything else (temporary files included)."""
    match = _MANIFEST_NAME.match(name)
    return int(match.group(1)) if match else None


def pack_path(digest: str) -> str:
    return f"{PACK_DIR}/{digest[:2]}/{digest}.pack"


def is_pack_path(path: str) -> bool:
    return bool(_PACK.match(path))


def marker_bytes() -> bytes:
    return json.dumps({"format": FORMAT, "layout": VERSION}).encode()


def check_marker(data: bytes, where: str) -> None:
    try:
        marker = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"store marker {where} is not JSON: {exc}") from exc
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a {FORMAT} store marker")
    layout = marker.get("layout")
    if not isinstance(layout, int) or layout > VERSION:
        raise FormatVersionError(
            f"{where} has layout version {layout!r}; this lightning-incremental reads up to "
            f"{VERSION} — upgrade lightning-incremental to read this store"
        )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(body: dict[str, Any]) -> bytes:
    """Serialise a manifest body with its checksum."""
    return json.dumps(
        {**body, "checksum": chunk_hash(_canonical(body))},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    ).encode()


def loads(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest.

    Raises:
        FormatVersionError: written by a newer format version.
        ManifestError: malformed, tampered (checksum), or naming paths outside the store.
    """
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {where} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ManifestError(f"manifest {where} is nested too deeply to be a manifest") from exc
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest {where} is not a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a {FORMAT} manifest (format={doc.get('format')!r})")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"manifest {where} has no integer format version")
    if version > VERSION:
        raise FormatVersionError(
            f"manifest {where} has format version {version}; this lightning-incremental reads up "
            f"to version {VERSION} — upgrade lightning-incremental to load it"
        )
    checksum = doc.pop("checksum", None)
    if not isinstance(checksum, str) or chunk_hash(_canonical(doc)) != checksum:
        raise ManifestError(f"manifest {where} fails its checksum: it was modified or corrupted")
    validate(doc, where)
    return doc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def validate(doc: dict[str, Any], where: str) -> None:
    """Structural validation: types, names, recipe closure and sizes.

    Raises:
        ManifestError: naming the first problem found.
    """
    for key, kind in _REQUIRED.items():
        value = doc.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ManifestError(f"manifest {where}: field {key!r} missing or not a {kind.__name__}")
    if doc["step"] < 0 or doc["chunk_size"] <= 0:
        raise ManifestError(f"manifest {where}: negative step or chunk size")
    if doc["step"] > MAX_STEP or doc["chunk_size"] > MAX_CHUNK_SIZE:
        raise ManifestError(f"manifest {where}: step or chunk size out of range")
    packs: dict[str, Any] = doc["packs"]
    for path, info in packs.items():
        _check_path(path, where)
        if not isinstance(info, dict) or not _nonneg_int(info.get("size")):
            raise ManifestError(f"manifest {where}: pack {path} has no valid size")
    chunks: dict[str, Any] = doc["chunks"]
    for digest, recipe in chunks.items():
        _check_recipe(digest, recipe, chunks, packs, where)
    for index, tensor in enumerate(doc["tensors"]):
        _check_tensor(index, tensor, chunks, where)


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_path(path: Any, where: str) -> None:
    if not isinstance(path, str):
        raise ManifestError(f"manifest {where}: object path {path!r} is not a string")
    if _PACK.match(path):
        return
    if ".." in path.split("/") or path.startswith(("/", "\\")) or "://" in path or ":" in path:
        raise ManifestError(
            f"manifest {where} names object path {path!r}, which is outside the store: "
            "refusing to read it (hostile or corrupted manifest)"
        )
    raise ManifestError(f"manifest {where}: malformed object path {path!r}")


def _check_recipe(
    digest: Any, recipe: Any, chunks: dict[str, Any], packs: dict[str, Any], where: str
) -> None:
    if not _HASH.match(digest):
        raise ManifestError(f"manifest {where}: malformed chunk hash {digest!r:.80}")
    if not isinstance(recipe, dict):
        raise ManifestError(f"manifest {where}: chunk {digest} has no recipe")
    _check_path(recipe.get("pack"), where)
    if recipe["pack"] not in packs:
        raise ManifestError(f"manifest {where}: chunk {digest} names unlisted pack")
    for key in ("offset", "length", "size", "depth", "chain"):
        if not _nonneg_int(recipe.get(key)):
            raise ManifestError(f"manifest {where}: chunk {digest} has a bad {key!r}")
    if recipe["size"] > MAX_CHUNK_SIZE:
        raise ManifestError(
            f"manifest {where}: chunk {digest} claims {recipe['size']} bytes, more than any "
            f"chunk holds ({MAX_CHUNK_SIZE})"
        )
    if recipe.get("width") not in (1, 2, 4, 8):
        raise ManifestError(f"manifest {where}: chunk {digest} has a bad byte-group width")
    if recipe["offset"] + recipe["length"] > packs[recipe["pack"]]["size"]:
        raise ManifestError(f"manifest {where}: chunk {digest} lies outside its pack")
    kind, base = recipe.get("kind"), recipe.get("base")
    if kind == KIND_FULL:
        if base is not None or recipe["depth"] != 0:
            raise ManifestError(f"manifest {where}: standalone chunk {digest} has a base")
    elif kind == KIND_XOR:
        base_recipe = chunks.get(base) if isinstance(base, str) else None
        if not isinstance(base_recipe, dict):
            raise ManifestError(f"manifest {where}: delta chunk {digest} lacks its base {base!r}")
        if (
            base_recipe.get("depth") != recipe["depth"] - 1
            or base_recipe.get("size") != recipe["size"]
        ):
            raise ManifestError(f"manifest {where}: delta chunk {digest} has an inconsistent base")
    else:
        raise ManifestError(f"manifest {where}: chunk {digest} has unknown kind {kind!r}")


def _check_tensor(index: int, tensor: Any, chunks: dict[str, Any], where: str) -> None:
    if not isinstance(tensor, dict):
        raise ManifestError(f"manifest {where}: tensor {index} is not an object")
    shape, hashes = tensor.get("shape"), tensor.get("chunks")
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise ManifestError(f"manifest {where}: tensor {index} has a bad shape")
    if not isinstance(tensor.get("dtype"), str) or not isinstance(tensor.get("path"), str):
        raise ManifestError(f"manifest {where}: tensor {index} has no dtype or path")
    if not _nonneg_int(tensor.get("nbytes")) or not isinstance(hashes, list):
        raise ManifestError(f"manifest {where}: tensor {index} has no size or chunk list")
    total = 0
    for digest in hashes:
        recipe = chunks.get(digest) if isinstance(digest, str) else None
        if recipe is None:
            raise ManifestError(f"manifest {where}: tensor {index} names unknown chunk {digest!r}")
        total += recipe["size"]
    if total != tensor["nbytes"]:
        raise ManifestError(
            f"manifest {where}: tensor {index} chunks hold {total} bytes, expected "
            f"{tensor['nbytes']}"
        )
    itemsize = _itemsize(tensor.get("dtype"), tensor.get("numpy"), where)
    if math.prod(shape) * itemsize != tensor["nbytes"]:
        raise ManifestError(
            f"manifest {where}: tensor {tensor['path']} has the wrong size: shape {shape} of "
            f"{tensor['dtype']} does not hold {tensor['nbytes']} bytes"
        )


def _itemsize(dtype: Any, is_numpy: Any, where: str) -> int:
    if is_numpy is True:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ManifestError(f"manifest {where}: bad numpy dtype {dtype!r}") from exc
        if np_dtype.kind not in "biufc" or np_dtype.hasobject:
            raise ManifestError(f"manifest {where}: numpy dtype {np_dtype} is not numeric")
        return int(np_dtype.itemsize)
    if is_numpy is not False:
        raise ManifestError(f"manifest {where}: tensor kind {is_numpy!r} is not a bool")
    return int(torch_dtype(dtype).itemsize)


def closure(digest: str, chunks: dict[str, Any]) -> list[str]:
    """The chain of ``digest``: its standalone base first, ``digest`` last."""
    chain = [digest]
    while chunks[chain[-1]]["kind"] == KIND_XOR:
        chain.append(chunks[chain[-1]]["base"])
    chain.reverse()
    return chain


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
