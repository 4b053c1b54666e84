"""A manifest's stored bytes: canonical JSON with an XXH3-128 checksum of itself (or, for many
tensors, the compact form of :mod:`~lightning_incremental.core.format.compact`), read back
through a cache of parsed manifests.

The checksum covers the canonical serialisation (sorted keys, no spaces, no NaN), so a flipped
bit in a shape or a plain value is detected like a flipped bit in tensor data. Parsing and
validation are :mod:`~lightning_incremental.core.format.validation`'s.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from lightning_incremental.core import codecs
from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import ManifestError
from lightning_incremental.core.format import compact
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.format.validation import check_version, parse


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(manifest: Manifest) -> bytes:
    """The stored bytes of ``manifest``: canonical JSON with its checksum, or the compact form
    for a manifest of many tensors (:func:`~lightning_incremental.core.format.compact.wanted`)."""
    return sign(compact.encode(manifest) if compact.wanted(manifest) else manifest.to_dict())


def sign(body: Mapping[str, Any]) -> bytes:
    """The stored bytes of a manifest's JSON object: canonical JSON with its checksum.

    Each top-level member is serialised once: canonical JSON of an object is its members'
    serialisations in key order, so the checksummed body and the stored bytes (the body with
    the checksum member in its place) are joined from the same pieces."""
    members = {
        key: json.dumps(key) + ":" + _canonical_value(value)
        for key, value in body.items()
        if key != "checksum"
    }
    unsigned = "{" + ",".join(members[k] for k in sorted(members)) + "}"
    members["checksum"] = '"checksum":' + json.dumps(chunk_hash(unsigned.encode()))
    return ("{" + ",".join(members[k] for k in sorted(members)) + "}").encode()


def _canonical_value(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


# Manifests kept parsed, by the hash of their bytes (see loads), up to this many bytes of them
# (their objects take a few times that): the newest ones of a store with tens of thousands of
# chunks, dozens of a small one.
PARSED_KEEP_BYTES = 4 << 20

_parsed: OrderedDict[tuple[str, tuple[str, ...]], tuple[Manifest, int]] = OrderedDict()

_parsed_bytes = 0

_parsed_lock = threading.Lock()


def loads(data: bytes, where: str) -> Manifest:
    """Parse and validate stored manifest bytes.

    The result for the same bytes (and the same registered codecs, which validation checks
    chunk kinds against) is kept for the next call: retention after every commit, a restore
    and the next save read the same committed manifests again, and checking one (its checksum
    re-serialises it) costs more than its read. Manifests are immutable; bytes that differ in
    any way are parsed and checked afresh.

    Raises:
        FormatVersionError: written by a newer format version.
        ManifestError: malformed, tampered (checksum), or naming paths outside the store.
    """
    key = (chunk_hash(data), tuple(codecs.kinds()))
    with _parsed_lock:
        known = _parsed.get(key)
        if known is not None:
            _parsed.move_to_end(key)
            return known[0]
    with collection_paused():
        doc, size = _loads(data, where)
    _remember(key, doc, size)
    return doc


def forget_parsed() -> None:
    """Drop every manifest kept parsed (see :func:`loads`): the next reads parse and check
    again, as a new process does."""
    global _parsed_bytes
    with _parsed_lock:
        _parsed.clear()
        _parsed_bytes = 0


def _remember(key: tuple[str, tuple[str, ...]], doc: Manifest, size: int) -> None:
    # ``size``: of the JSON form (a compact manifest's tables), what its objects scale with
    global _parsed_bytes
    if size > PARSED_KEEP_BYTES:
        return
    with _parsed_lock:
        old = _parsed.pop(key, None)
        _parsed_bytes -= old[1] if old is not None else 0
        _parsed[key] = (doc, size)
        _parsed_bytes += size
        while _parsed_bytes > PARSED_KEEP_BYTES:
            _parsed_bytes -= _parsed.popitem(last=False)[1][1]


def _loads(data: bytes, where: str) -> tuple[Manifest, int]:
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {where} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ManifestError(f"manifest {where} is nested too deeply to be a manifest") from exc
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest {where} is not a JSON object")
    check_version(doc, where)
    checksum = doc.pop("checksum", None)
    if not isinstance(checksum, str) or chunk_hash(_canonical(doc)) != checksum:
        raise ManifestError(f"manifest {where} fails its checksum: it was modified or corrupted")
    if compact.is_compact(doc):
        return compact.read(doc, where)
    return parse(doc, where), len(data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def seal(manifest: Manifest, where: str) -> tuple[bytes, Manifest]:
    """The stored bytes of ``manifest`` (see :func:`dumps`), checked as if read back (e.g. one
    assembled from parts): they parse and validate. Returns them with the manifest as a reader
    gets it from them, which is also kept for the next :func:`loads` of these bytes (use it in
    place of ``manifest``: one copy in memory).

    Raises:
        ManifestError: naming the first problem.
    """
    kinds = tuple(codecs.kinds())
    with collection_paused():
        data = dumps(manifest)
        doc, size = json.loads(data), len(data)
        doc.pop("checksum")
        if compact.is_compact(doc):
            parsed, size = compact.read(doc, where)
        else:
            parsed = parse(doc, where)
    _remember((chunk_hash(data), kinds), parsed, size)
    return data, parsed


def validate(manifest: Manifest, where: str) -> Manifest:
    """``manifest`` checked as if it had been read (e.g. one assembled from parts): what
    :func:`seal` returns besides the bytes.

    Raises:
        ManifestError: naming the first problem.
    """
    return seal(manifest, where)[1]
