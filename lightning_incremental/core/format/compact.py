"""The compact manifest (format version 4): what a checkpoint of many tensors stores per save.

A manifest is self-contained (see :mod:`~lightning_incremental.core.format.records`), so a save
in which nothing changed still names every tensor and chunk: in the JSON form that costs about
440 bytes per tensor, 44 MB per save at 100,000 tensors. A manifest of at least
:data:`COMPACT_FROM` tensors and chunks together is written compact instead: still one JSON
object with its checksum, holding in the clear the fields a person or a tool looks for first
(format, version, step, parent, generation, since_base, chunk_size, created) and, as
``"tables"``, one zstd frame (base64) of the canonical JSON of the manifest by column — packs as
a list, every chunk by its index in a chunk table, every tensor's fields in columns.

Columns turn the repetition of a manifest (the same keys, the same pack paths, key paths that
differ in a layer number, a 32-hex hash spelled once instead of once per use) into what zstd
removes: about 40 bytes per single-chunk tensor, most of it the chunk's hash, which no encoding
makes smaller. The reader expands the tables to the JSON form and validates it exactly as it
validates a JSON manifest (:func:`~lightning_incremental.core.format.validation.parse`), so both
forms accept and refuse the same checkpoints.

Why not a manifest that refers to its parent's entries: every manifest would then need its
parent's to be read, retention could no longer drop a parent whose child it keeps, and one
corrupt manifest would break every later one. Compact manifests stay self-contained, at a few
tens of bytes per tensor. Small manifests stay in the JSON form (versions 1 to 3), readable by
earlier releases and by people. The compact form stays JSON too (base64 costs a third more than
raw bytes, 28 to 36 bytes per tensor in all), so that an earlier release reads its version and
says to upgrade, as for any newer format, instead of calling the checkpoint corrupt.

What a reader expands is bounded by what it read (:func:`limit`): the tables' declared size is
checked against the characters stored for them before anything is decompressed, and the frame
is decompressed in pieces, stopping at that size, so a forged frame (a size it does not hold, no
size at all, or a few kilobytes that expand to gigabytes) costs its reader at most that bound
and is a :class:`~lightning_incremental.core.errors.ManifestError`, like any corrupt manifest.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

import zstandard

from lightning_incremental.core.errors import ManifestError
from lightning_incremental.core.format import columns
from lightning_incremental.core.format.layout import FORMAT
from lightning_incremental.core.format.records import COMPACT_VERSION, Manifest
from lightning_incremental.core.format.validation import parse

COMPACT_FROM = 1024  # tensors and chunks from which a manifest is written compact
# zstd level of the tables. Measured on the tables of 20,000 tensors of a synthetic state and
# of 8,442 of an MoE-like one (experts, attention, optimizer state): level 6 wrote 0.2 % and
# 2.3 % fewer bytes than 3, in three times the time (15.8 ms against 5.4, 6.7 against 2.2);
# the chunk hashes, incompressible, are most of the frame. Every save writes one.
LEVEL = 3
# The tables hold at most RATIO bytes per character stored for them (the frame's base64 and its
# filler, "pad"), plus SLACK: what a reader decompresses and parses, whatever the frame claims.
# Measured at level 3, bytes of tables per character of the manifest: 6.2 to 6.8 for 20,000 and
# 100,000 tensors of random values (what models hold), 25 to 36 for as many equal tensors (one
# shared chunk), 43 for 100,000 scalars, 65 for 100,000 equal scalars under 90-character key
# paths (within the bound with SLACK); plain values compress without a limit (a list of a
# million zeros in the state: 360). Tables up to SLACK need no ratio at all (a manifest of some
# 20,000 tensors, or a state holding a few MB of repetitive plain values). The writer keeps
# every manifest within the bound: tables that compress better than RATIO get filler,
# characters a reader counts but never decodes (four million zeros in the state: 54 KB of
# filler in a manifest of 61 KB, where the JSON form would take 8 MB). A reader's parse of the
# tables takes a few times their size in objects (13 times for 100,000 scalars), so the 0.5 MB
# manifest of a hostile writer costs it at most 36 MB of tables, not the gigabytes it claims.
RATIO = 64
SLACK = 4 << 20
_PIECE = 1 << 20  # bytes decompressed at a time
ENCODING = "zstd+json+base64"
HEADER = ("format", "version", "step", "parent", "generation", "since_base", "chunk_size")
_TENSOR_COLUMNS = ("path", "dtype", "shape", "nbytes", "width", "device")
_FLAGS = ("numpy", "param", "requires_grad")
_CHUNK_COLUMNS = ("offset", "length", "size", "width", "kind", "depth", "chain")


def wanted(manifest: Manifest) -> bool:
    """Whether ``manifest`` is written compact."""
    return len(manifest.tensors) + len(manifest.chunks) >= COMPACT_FROM


def is_compact(doc: Mapping[str, Any]) -> bool:
    """Whether a stored manifest's JSON object is the compact form."""
    return doc.get("version") == COMPACT_VERSION


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def limit(stored: int) -> int:
    """The most bytes the tables of a compact manifest may hold when ``stored`` characters are
    stored for them (their base64 and filler): what a reader decompresses at most."""
    return RATIO * stored + SLACK


def encode(manifest: Manifest) -> dict[str, Any]:
    """The compact form of ``manifest``: the JSON object to sign and store."""
    plain = _canonical(_tables(manifest))
    frame = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True).compress(plain)
    data = base64.b64encode(frame).decode("ascii")
    tables = {"encoding": ENCODING, "size": len(plain), "data": data}
    short = math.ceil(max(len(plain) - SLACK, 0) / RATIO) - len(data)
    if short > 0:  # compresses better than a reader accepts: filler makes up the difference
        tables["pad"] = "0" * short
    return {
        "format": FORMAT,
        "version": COMPACT_VERSION,
        "step": manifest.step,
        "parent": manifest.parent,
        "generation": manifest.generation,
        "since_base": manifest.since_base,
        "chunk_size": manifest.chunk_size,
        "created": manifest.created,
        "tables": tables,
    }


def _tables(manifest: Manifest) -> dict[str, Any]:
    packs = list(manifest.packs)
    pack_index = {path: i for i, path in enumerate(packs)}
    digests = list(manifest.chunks)
    chunk_index = {digest: i for i, digest in enumerate(digests)}
    recipes = list(manifest.chunks.values())
    chunks: dict[str, Any] = {
        "hash": digests,
        "pack": [pack_index[r.pack] for r in recipes],
        "base": [chunk_index[r.base] if r.base is not None else -1 for r in recipes],
        "decoded": {str(i): r.decoded for i, r in enumerate(recipes) if not r.lossless},
    }
    # one pass over the records, then transposed (a pass per column costs a getattr each)
    rows = [(r.offset, r.length, r.size, r.width, r.kind, r.depth, r.chain) for r in recipes]
    for column, values in zip(_CHUNK_COLUMNS, zip(*rows) if rows else [()] * 7, strict=True):
        chunks[column] = list(values)
    entries = manifest.tensors
    fields = [
        (t.path, t.dtype, t.shape, t.nbytes, t.width, t.device,
         int(t.numpy), int(t.param), int(t.requires_grad))
        for t in entries
    ]  # fmt: skip
    names = (*_TENSOR_COLUMNS, *_FLAGS)
    columns = zip(*fields) if fields else [()] * len(names)
    tensors: dict[str, Any] = {c: list(v) for c, v in zip(names, columns, strict=True)}
    tensors["chunks"] = [
        [chunk_index[d] for d in t.chunks] if t.pieces is None else None for t in entries
    ]
    tensors["pieces"] = {
        str(i): [[p.offsets, p.sizes, [chunk_index[d] for d in p.chunks]] for p in t.pieces]
        for i, t in enumerate(entries)
        if t.pieces is not None
    }
    return {
        "packs": [[path, manifest.packs[path]] for path in packs],
        "chunks": chunks,
        "tensors": tensors,
        "audit": manifest.audit,
        "stats": manifest.stats,
        "pickled": list(manifest.pickled),
        "tree": manifest.tree,
        "extra": dict(manifest.extra),
    }


def expand(doc: Mapping[str, Any], where: str) -> tuple[dict[str, Any], int]:
    """The JSON form of a compact manifest's object (checksum already checked), to validate
    with ``parse``, and the size of its tables.

    Raises:
        ManifestError: malformed tables.
    """
    tables, size = _decoded(doc, where)
    return _guarded(lambda: _document(doc, tables), where), size


def read(doc: Mapping[str, Any], where: str) -> tuple[Manifest, int]:
    """The manifest of a compact manifest's object (checksum already checked), validated, and
    the size of its tables: read column by column (:mod:`.columns`) where that path decides,
    else expanded to the JSON form and validated as that is.

    Raises:
        FormatVersionError: a newer format version.
        ManifestError: malformed tables, or an invalid manifest (naming the first problem).
    """
    tables, size = _decoded(doc, where)
    fast = columns.manifest(doc, tables, where, _document)
    if fast is not None:
        return fast, size
    return parse(_guarded(lambda: _document(doc, tables), where), where), size


def _decoded(doc: Mapping[str, Any], where: str) -> tuple[Any, int]:
    """The tables of a compact manifest's object, decoded from their zstd frame and JSON: their
    declared size checked against :func:`limit` first, the frame decompressed in pieces up to
    that size (so whatever it claims or holds, no more is ever held)."""
    info = doc.get("tables")

    def decode() -> tuple[Any, int]:
        if not isinstance(info, dict) or info.get("encoding") != ENCODING:
            raise ValueError("no tables of a known encoding")
        size, data, pad = info.get("size"), info.get("data"), info.get("pad", "")
        if type(size) is not int or not isinstance(data, str) or not isinstance(pad, str):
            raise ValueError("the tables have no size or data")
        most = limit(len(data) + len(pad))
        if not 0 <= size <= most:
            raise ValueError(
                f"the tables declare {size} bytes, more than the {len(data) + len(pad)} "
                f"characters stored for them may expand to (at most {most}); not decompressed"
            )
        frame = base64.b64decode(data, validate=True)
        if zstandard.frame_content_size(frame) != size:
            raise ValueError(f"the tables do not hold the {size} bytes they declare")
        return json.loads(_inflate(frame, size)), size

    return _guarded(decode, where)


def _inflate(frame: bytes, size: int) -> bytearray:
    """The content of the zstd ``frame``, which must be ``size`` bytes: read a piece at a time
    and refused as soon as it holds more, so a frame that lies about its size costs no more
    memory than the size it declares (which :func:`limit` bounded)."""
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
        while len(out) <= size:
            piece = reader.read(min(_PIECE, size + 1 - len(out)))
            if not piece:
                break
            out += piece
    if len(out) != size:
        raise ValueError(f"the tables do not hold the {size} bytes they declare")
    return out


def _guarded(work: Any, where: str) -> Any:
    try:
        return work()
    except (ValueError, zstandard.ZstdError, KeyError, IndexError, TypeError) as exc:
        raise ManifestError(f"manifest {where}: its tables are malformed: {exc}") from exc
    except RecursionError as exc:
        raise ManifestError(f"manifest {where} is nested too deeply to be a manifest") from exc


def _document(header: Mapping[str, Any], tables: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form of a manifest from its object (``header``: the fields in the clear) and
    its tables (any error: malformed). Fields in the clear this reader does not know are kept,
    as the JSON form keeps them.

    Column by column (``zip``), every index checked as it is used: a column shorter than the
    table is an error, as is an index that is not a non-negative int in range."""
    packs = {str(path): {"size": size} for path, size in tables["packs"]}
    pack_names = [str(path) for path, _ in tables["packs"]]
    c = tables["chunks"]
    digests: list[str] = c["hash"]
    decoded: dict[str, str] = c["decoded"]
    n = len(digests)
    columns = [_column(c, name, n) for name in ("pack", "base", *_CHUNK_COLUMNS)]
    chunks: dict[str, Any] = {}
    for i, digest, pack, base, *values in zip(range(n), digests, *columns):
        recipe = dict(zip(_CHUNK_COLUMNS, values))
        recipe["pack"] = pack_names[_index(pack)]
        recipe["base"] = digests[_index(base)] if base != -1 else None
        if decoded and str(i) in decoded:
            recipe["lossless"], recipe["decoded"] = False, decoded[str(i)]
        chunks[digest] = recipe
    if len(chunks) != len(digests):
        raise ValueError("a chunk is listed twice")
    t = tables["tensors"]
    pieces: dict[str, Any] = t["pieces"]
    listed_chunks = t["chunks"]
    m = len(listed_chunks)
    names = (*_TENSOR_COLUMNS, *_FLAGS)
    tensor_columns = [_column(t, name, m) for name in names]
    flags = len(_TENSOR_COLUMNS)
    tensors = []
    for i, listed, *values in zip(range(m), listed_chunks, *tensor_columns):
        entry = dict(zip(_TENSOR_COLUMNS, values))
        for flag, bit in zip(_FLAGS, values[flags:]):
            entry[flag] = bool(_bit(bit))
        if pieces and str(i) in pieces:
            entry["pieces"] = [
                {"offsets": offsets, "sizes": sizes, "chunks": [digests[_index(j)] for j in own]}
                for offsets, sizes, own in pieces[str(i)]
            ]
        else:
            entry["chunks"] = [digests[_index(j)] for j in listed]
        tensors.append(entry)
    known = (*HEADER, "created", "tables", "checksum")
    extra = {**tables["extra"], **{k: v for k, v in header.items() if k not in known}}
    return {
        **extra,
        **{key: header[key] for key in HEADER if key in header},
        "created": header.get("created"),
        "audit": tables["audit"],
        "stats": tables["stats"],
        "pickled": tables["pickled"],
        "tree": tables["tree"],
        "tensors": tensors,
        "chunks": chunks,
        "packs": packs,
    }


def _column(table: Mapping[str, Any], name: str, length: int) -> list[Any]:
    column = table[name]
    if not isinstance(column, list) or len(column) < length:
        raise ValueError(f"column {name!r} is shorter than its table")
    return column


def _index(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"bad table index {value!r}")
    return value


def _bit(value: Any) -> int:
    if value not in (0, 1) or isinstance(value, bool):
        raise ValueError(f"bad flag {value!r}")
    return int(value)
