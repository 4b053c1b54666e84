"""The manifest format: typed records of one checkpoint, parsed from and written to JSON.

A manifest is self-contained: its ``chunks`` table holds the recipe of every chunk needed to
restore the checkpoint, including the bases of deltas, so restore reads one manifest and
garbage collection knows every live object from the kept manifests alone. JSON of a chunk
recipe (keyed by the XXH3-128 of the chunk's raw bytes)::

    {"pack": "packs/ab/<32 hex>.pack", "offset": int, "length": int,  # its encoded bytes
     "size": int, "width": int, "kind": "z" | "x" | ...,  # raw size, byte-group width, codec
     "base": "<32 hex>" | null, "depth": int, "chain": int,  # delta base, chain length, bytes
     "lossless": false, "decoded": "<32 hex>"}  # only for a lossy codec's chunk

The manifest carries an XXH3-128 checksum of its own canonical JSON, so a flipped bit in a shape
or a plain value is detected like a flipped bit in tensor data. Format version 2 added lossy
chunks; version 3 added sharded tensors, stored as *pieces*: a tensor entry with ``"pieces"``
instead of ``"chunks"`` records its global shape and dtype, and for every stored piece (a dense
box of the global tensor, written by the rank that held it) its offsets, sizes and the chunks of
its row-major bytes::

    {"path": ..., "dtype": ..., "shape": [global], "nbytes": global bytes, ...,
     "pieces": [{"offsets": [int, ...], "sizes": [int, ...], "chunks": ["<32 hex>", ...]}]}

The pieces must tile the tensor exactly (:func:`~lightning_incremental.core.pieces.check_tiling`).
A manifest is written with the least version that holds it: 1 without lossy chunks or pieces,
so every reader reads what an older writer wrote and what a non-sharded save writes.

Parsing validates everything a reader relies on (types, object paths inside the store, recipe
closure, sizes, known codecs) and rejects anything else with a :class:`ManifestError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import HASH_LEN, chunk_hash
from lightning_incremental.core.errors import FormatVersionError, ManifestError
from lightning_incremental.core.manifest import FORMAT, MAX_CHUNK_SIZE, MAX_STEP, PACK_DIR
from lightning_incremental.core.pieces import Box, check_tiling
from lightning_incremental.core.tree import piece_key, torch_dtype

VERSION = 3  # the newest format version this library reads and writes
LOSSLESS_VERSION = 1  # what a manifest without lossy chunks or pieces is written as
LOSSY_VERSION = 2  # the first version with lossy chunks
PIECES_VERSION = 3  # the first version with sharded tensors (pieces)

_HASH = re.compile(rf"^[0-9a-f]{{{HASH_LEN}}}$")
_PACK = re.compile(rf"^{PACK_DIR}/[0-9a-f]{{2}}/[0-9a-f]{{{HASH_LEN}}}\.pack$")
_FIELDS = (  # the top-level fields a manifest holds, every other key is kept as ``extra``
    "format", "version", "step", "parent", "generation", "since_base", "chunk_size", "created",
    "audit", "stats", "pickled", "tree", "tensors", "chunks", "packs",
)  # fmt: skip


@dataclass(frozen=True)
class ChunkRecipe:
    """How to restore one chunk: where its payload lies and which codec decodes it.

    ``base`` names the chunk a delta codec's payload is relative to (``depth``: links below it,
    ``chain``: payload bytes of the whole chain). ``lossless`` is False for a lossy codec's chunk,
    whose decoded bytes are checked against ``decoded`` instead of the chunk's own hash.
    """

    kind: str
    pack: str
    offset: int
    length: int
    size: int
    width: int
    base: str | None = None
    depth: int = 0
    chain: int = 0
    lossless: bool = True
    decoded: str | None = None

    def expected(self, digest: str) -> str:
        """The hash restore checks this chunk's decoded bytes against (``digest``: its key)."""
        return digest if self.lossless else self.decoded  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pack": self.pack,
            "offset": self.offset,
            "length": self.length,
            "size": self.size,
            "width": self.width,
            "kind": self.kind,
            "base": self.base,
            "depth": self.depth,
            "chain": self.chain,
        }
        if not self.lossless:
            out["lossless"] = False
            out["decoded"] = self.decoded
        return out


@dataclass(frozen=True)
class PieceEntry:
    """A stored piece of a sharded tensor: a dense box of the global tensor, and the chunks of
    its row-major bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[str, ...]

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "chunks": list(self.chunks),
        }


@dataclass(frozen=True)
class TensorEntry:
    """One tensor (or numpy array) of the state: its key path, type, and chunk hashes.

    A sharded tensor has ``pieces`` (None otherwise): ``shape`` and ``nbytes`` are then the
    global tensor's, and ``chunks`` is every piece's chunks in piece order (what the tensor
    needs; the bytes of the global tensor are not their concatenation).
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    width: int
    device: str
    numpy: bool
    param: bool
    requires_grad: bool
    chunks: tuple[str, ...]
    pieces: tuple[PieceEntry, ...] | None = None

    @property
    def itemsize(self) -> int:
        return self.nbytes // math.prod(self.shape) if math.prod(self.shape) else 0

    def stored_pieces(self) -> list[tuple[Box, tuple[str, ...]]]:
        """The stored boxes of the tensor and their chunks: its pieces, or the whole tensor."""
        if self.pieces is None:
            return [(Box(tuple(0 for _ in self.shape), self.shape), self.chunks)]
        return [(p.box, p.chunks) for p in self.pieces]

    def arrays(self) -> list[TensorEntry]:
        """The entry as the flat arrays a writer encoded: itself, or one entry per piece keyed
        by :func:`~lightning_incremental.core.tree.piece_key` (how a rank finds its own
        piece's chunks as the delta base of its next save)."""
        if self.pieces is None:
            return [self]
        size = self.nbytes // math.prod(self.shape) if math.prod(self.shape) else 0
        return [
            dataclasses.replace(
                self,
                path=piece_key(self.path, p.offsets),
                shape=p.sizes,
                nbytes=math.prod(p.sizes) * size,
                chunks=p.chunks,
                pieces=None,
            )
            for p in self.pieces
        ]

    def to_dict(self) -> dict[str, Any]:
        out = self._fields()
        if self.pieces is not None:
            del out["chunks"]
            out["pieces"] = [p.to_dict() for p in self.pieces]
        return out

    def _fields(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "width": self.width,
            "device": self.device,
            "numpy": self.numpy,
            "param": self.param,
            "requires_grad": self.requires_grad,
            "chunks": list(self.chunks),
        }


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint.

    Attributes:
        step, parent, generation: the checkpoint, the one it was encoded against (None for the
            first), the fencing generation of its writer.
        since_base: checkpoints since the last full base (0: this is one).
        chunk_size: bytes per chunk the tensors were cut into.
        created: ISO 8601 time of the commit.
        audit: who, where and with what it was written, and the caller's metadata.
        stats: figures of the save (bytes, chunk counts).
        pickled: key paths of pickled values in ``tree``.
        tree: the skeleton of the state (see :mod:`~lightning_incremental.core.tree`).
        tensors: the state's tensors, in the order ``tree`` refers to them.
        chunks: every chunk the tensors need, and every delta base of those, by hash.
        packs: every object the chunks lie in, with its size in bytes.
        version: the format version read (written: the least one that holds the manifest).
        extra: fields of a newer writer this reader does not know, kept as they are.
    """

    step: int
    generation: int
    since_base: int
    chunk_size: int
    created: str
    tensors: tuple[TensorEntry, ...]
    chunks: Mapping[str, ChunkRecipe]
    packs: Mapping[str, int]
    parent: int | None = None
    audit: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)
    pickled: tuple[str, ...] = ()
    tree: Any = None
    version: int = LOSSLESS_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        """Whether every chunk restores bit-exact."""
        return all(r.lossless for r in self.chunks.values())

    @property
    def sharded(self) -> bool:
        """Whether a tensor is stored as pieces (format version 3)."""
        return any(t.pieces is not None for t in self.tensors)

    @property
    def lossy_tensors(self) -> list[str]:
        """Key paths of the tensors with a lossy chunk."""
        return [t.path for t in self.tensors if not all(self.chunks[d].lossless for d in t.chunks)]

    def to_dict(self) -> dict[str, Any]:
        """The manifest as the JSON object stored (without its checksum)."""
        return {
            **self.extra,
            "format": FORMAT,
            "version": PIECES_VERSION
            if self.sharded
            else LOSSLESS_VERSION
            if self.lossless
            else LOSSY_VERSION,
            "step": self.step,
            "parent": self.parent,
            "generation": self.generation,
            "since_base": self.since_base,
            "chunk_size": self.chunk_size,
            "created": self.created,
            "audit": self.audit,
            "stats": self.stats,
            "pickled": list(self.pickled),
            "tree": self.tree,
            "tensors": [t.to_dict() for t in self.tensors],
            "chunks": {d: r.to_dict() for d, r in self.chunks.items()},
            "packs": {p: {"size": s} for p, s in self.packs.items()},
        }


def closure(digest: str, chunks: Mapping[str, ChunkRecipe]) -> list[str]:
    """The chain of ``digest``: its standalone base first, ``digest`` last."""
    chain = [digest]
    while (base := chunks[chain[-1]].base) is not None:
        chain.append(base)
    chain.reverse()
    return chain


# ---------------------------------------------------------------- JSON


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(manifest: Manifest) -> bytes:
    """The stored bytes of ``manifest``: canonical JSON with its checksum."""
    return sign(manifest.to_dict())


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
    doc = _loads(data, where)
    _remember(key, doc, len(data))
    return doc


def forget_parsed() -> None:
    """Drop every manifest kept parsed (see :func:`loads`): the next reads parse and check
    again, as a new process does."""
    global _parsed_bytes
    with _parsed_lock:
        _parsed.clear()
        _parsed_bytes = 0


def _remember(key: tuple[str, tuple[str, ...]], doc: Manifest, size: int) -> None:
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


def _loads(data: bytes, where: str) -> Manifest:
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {where} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ManifestError(f"manifest {where} is nested too deeply to be a manifest") from exc
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest {where} is not a JSON object")
    _check_version(doc, where)
    checksum = doc.pop("checksum", None)
    if not isinstance(checksum, str) or chunk_hash(_canonical(doc)) != checksum:
        raise ManifestError(f"manifest {where} fails its checksum: it was modified or corrupted")
    return parse(doc, where)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def _check_version(doc: dict[str, Any], where: str) -> int:
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
    return version


# ---------------------------------------------------------------- validation


def parse(doc: Mapping[str, Any], where: str) -> Manifest:
    """The typed manifest of a JSON object (checksum already removed), validated: types, object
    paths, recipe closure and sizes, codecs known to the registry.

    Raises:
        FormatVersionError: a newer format version. ManifestError: naming the first problem.
    """
    version = _check_version(dict(doc), where)
    _require(doc, "step", int, where)
    for key in ("generation", "since_base", "chunk_size"):
        _require(doc, key, int, where)
    step, chunk_size = doc["step"], doc["chunk_size"]
    if step < 0 or chunk_size <= 0:
        raise ManifestError(f"manifest {where}: negative step or chunk size")
    if step > MAX_STEP or chunk_size > MAX_CHUNK_SIZE:
        raise ManifestError(f"manifest {where}: step or chunk size out of range")
    for key, kind in (("created", str), ("audit", dict), ("stats", dict), ("pickled", list)):
        _require(doc, key, kind, where)
    for key, kind in (("tensors", list), ("chunks", dict), ("packs", dict)):
        _require(doc, key, kind, where)
    if not all(isinstance(p, str) for p in doc["pickled"]):
        raise ManifestError(f"manifest {where}: field 'pickled' holds a non-string key path")
    parent = doc.get("parent")
    if parent is not None and not _nonneg_int(parent):
        raise ManifestError(f"manifest {where}: field 'parent' is not a step")
    packs = {path: _pack_size(path, info, where) for path, info in doc["packs"].items()}
    raw_chunks: dict[str, Any] = doc["chunks"]
    chunks = {d: _recipe(d, r, packs, version, where) for d, r in raw_chunks.items()}
    for digest, recipe in chunks.items():
        _check_base(digest, recipe, chunks, where)
    tensors = tuple(_tensor(i, t, chunks, version, where) for i, t in enumerate(doc["tensors"]))
    return Manifest(
        step=step,
        parent=parent,
        generation=doc["generation"],
        since_base=doc["since_base"],
        chunk_size=chunk_size,
        created=doc["created"],
        audit=doc["audit"],
        stats=doc["stats"],
        pickled=tuple(doc["pickled"]),
        tree=doc.get("tree"),
        tensors=tensors,
        chunks=chunks,
        packs=packs,
        version=version,
        extra={k: v for k, v in doc.items() if k not in _FIELDS and k != "checksum"},
    )


def seal(manifest: Manifest, where: str) -> tuple[bytes, Manifest]:
    """The stored bytes of ``manifest`` (see :func:`dumps`), checked as if read back (e.g. one
    assembled from parts): they parse and validate. Returns them with the manifest as a reader
    gets it from them, which is also kept for the next :func:`loads` of these bytes (use it in
    place of ``manifest``: one copy in memory).

    Raises:
        ManifestError: naming the first problem.
    """
    kinds = tuple(codecs.kinds())
    data = dumps(manifest)
    doc = json.loads(data)
    doc.pop("checksum")
    parsed = parse(doc, where)
    _remember((chunk_hash(data), kinds), parsed, len(data))
    return data, parsed


def validate(manifest: Manifest, where: str) -> Manifest:
    """``manifest`` checked as if it had been read (e.g. one assembled from parts): what
    :func:`seal` returns besides the bytes.

    Raises:
        ManifestError: naming the first problem.
    """
    return seal(manifest, where)[1]


def _require(doc: Mapping[str, Any], key: str, kind: type, where: str) -> None:
    value = doc.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"manifest {where}: field {key!r} missing or not a {kind.__name__}")


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_path(path: Any, where: str) -> str:
    """``path`` when it names a pack object of the store.

    Raises:
        ManifestError: anything else; a path outside the store is called out as such.
    """
    if not isinstance(path, str):
        raise ManifestError(f"manifest {where}: object path {path!r} is not a string")
    if _PACK.match(path):
        return path
    if ".." in path.split("/") or path.startswith(("/", "\\")) or "://" in path or ":" in path:
        raise ManifestError(
            f"manifest {where} names object path {path!r}, which is outside the store: "
            "refusing to read it (hostile or corrupted manifest)"
        )
    raise ManifestError(f"manifest {where}: malformed object path {path!r}")


def _pack_size(path: Any, info: Any, where: str) -> int:
    check_path(path, where)
    if not isinstance(info, dict) or not _nonneg_int(info.get("size")):
        raise ManifestError(f"manifest {where}: pack {path} has no valid size")
    return int(info["size"])


def _recipe(
    digest: Any, raw: Any, packs: Mapping[str, int], version: int, where: str
) -> ChunkRecipe:
    if not isinstance(digest, str) or not _HASH.match(digest):
        raise ManifestError(f"manifest {where}: malformed chunk hash {digest!r:.80}")
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest {where}: chunk {digest} has no recipe")
    pack = check_path(raw.get("pack"), where)
    if pack not in packs:
        raise ManifestError(f"manifest {where}: chunk {digest} names unlisted pack")
    for key in ("offset", "length", "size", "depth", "chain"):
        if not _nonneg_int(raw.get(key)):
            raise ManifestError(f"manifest {where}: chunk {digest} has a bad {key!r}")
    if raw["size"] > MAX_CHUNK_SIZE:
        raise ManifestError(
            f"manifest {where}: chunk {digest} claims {raw['size']} bytes, more than any "
            f"chunk holds ({MAX_CHUNK_SIZE})"
        )
    if raw.get("width") not in (1, 2, 4, 8) or isinstance(raw.get("width"), bool):
        raise ManifestError(f"manifest {where}: chunk {digest} has a bad byte-group width")
    if raw["offset"] + raw["length"] > packs[pack]:
        raise ManifestError(f"manifest {where}: chunk {digest} lies outside its pack")
    try:
        codec = codecs.get(raw.get("kind"))
    except ValueError as exc:
        raise ManifestError(f"manifest {where}: chunk {digest}: {exc}") from exc
    lossless, decoded = raw.get("lossless", True), raw.get("decoded")
    if lossless is not codec.lossless:
        raise ManifestError(
            f"manifest {where}: chunk {digest} of codec {codec.kind!r} is labelled "
            f"lossless={lossless!r}, the codec is {'lossless' if codec.lossless else 'lossy'}"
        )
    if lossless:
        if decoded is not None:
            raise ManifestError(f"manifest {where}: lossless chunk {digest} has a decoded hash")
    elif version < LOSSY_VERSION or not isinstance(decoded, str) or not _HASH.match(decoded):
        raise ManifestError(
            f"manifest {where}: lossy chunk {digest} lacks the hash of its decoded bytes"
        )
    base = raw.get("base")
    if codec.needs_base:
        if not isinstance(base, str):
            raise ManifestError(f"manifest {where}: delta chunk {digest} lacks its base {base!r}")
    elif base is not None or raw["depth"] != 0:
        raise ManifestError(f"manifest {where}: standalone chunk {digest} has a base")
    return ChunkRecipe(
        kind=codec.kind,
        pack=pack,
        offset=raw["offset"],
        length=raw["length"],
        size=raw["size"],
        width=raw["width"],
        base=base,
        depth=raw["depth"],
        chain=raw["chain"],
        lossless=lossless,
        decoded=decoded,
    )


def _check_base(
    digest: str, recipe: ChunkRecipe, chunks: Mapping[str, ChunkRecipe], where: str
) -> None:
    if recipe.base is None:
        return
    base = chunks.get(recipe.base)
    if base is None:
        raise ManifestError(
            f"manifest {where}: delta chunk {digest} lacks its base {recipe.base!r}"
        )
    if base.depth != recipe.depth - 1 or base.size != recipe.size:
        raise ManifestError(f"manifest {where}: delta chunk {digest} has an inconsistent base")
    # A lossless delta needs a lossless base; a lossy one a chunk of its own code family.
    family = {recipe.kind, codecs.get(recipe.kind).standalone}
    if not (base.lossless if recipe.lossless else base.kind in family):
        raise ManifestError(f"manifest {where}: delta chunk {digest} has an inconsistent base")


def _tensor(
    index: int, raw: Any, chunks: Mapping[str, ChunkRecipe], version: int, where: str
) -> TensorEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest {where}: tensor {index} is not an object")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise ManifestError(f"manifest {where}: tensor {index} has a bad shape")
    if not isinstance(raw.get("dtype"), str) or not isinstance(raw.get("path"), str):
        raise ManifestError(f"manifest {where}: tensor {index} has no dtype or path")
    if not _nonneg_int(raw.get("nbytes")):
        raise ManifestError(f"manifest {where}: tensor {index} has no size")
    if raw.get("width") not in (1, 2, 4, 8) or isinstance(raw.get("width"), bool):
        raise ManifestError(f"manifest {where}: tensor {index} has a bad byte-group width")
    if not isinstance(raw.get("device"), str):
        raise ManifestError(f"manifest {where}: tensor {index} has no device")
    for key in ("param", "requires_grad"):
        if not isinstance(raw.get(key), bool):
            raise ManifestError(f"manifest {where}: tensor {index} has no boolean {key!r}")
    itemsize = _itemsize(raw.get("dtype"), raw.get("numpy"), where)
    pieces = None
    if "pieces" in raw:
        if version < PIECES_VERSION or "chunks" in raw or raw.get("numpy") is not False:
            raise ManifestError(
                f"manifest {where}: tensor {index} has pieces, which need format version "
                f"{PIECES_VERSION}, no chunk list of its own, and a torch dtype"
            )
        pieces = _pieces(index, raw, chunks, itemsize, where)
        hashes: list[Any] = [d for p in pieces for d in p.chunks]
    else:
        hashes = raw.get("chunks")  # type: ignore[assignment]
        if not isinstance(hashes, list):
            raise ManifestError(f"manifest {where}: tensor {index} has no chunk list")
        total = _chunk_bytes(index, hashes, chunks, where)
        if total != raw["nbytes"]:
            raise ManifestError(
                f"manifest {where}: tensor {index} chunks hold {total} bytes, expected "
                f"{raw['nbytes']}"
            )
    if math.prod(shape) * itemsize != raw["nbytes"]:
        raise ManifestError(
            f"manifest {where}: tensor {raw['path']} has the wrong size: shape {shape} of "
            f"{raw['dtype']} does not hold {raw['nbytes']} bytes"
        )
    return TensorEntry(
        path=raw["path"],
        dtype=raw["dtype"],
        shape=tuple(shape),
        nbytes=raw["nbytes"],
        width=raw["width"],
        device=raw["device"],
        numpy=raw["numpy"],
        param=raw["param"],
        requires_grad=raw["requires_grad"],
        chunks=tuple(hashes),
        pieces=pieces,
    )


def _chunk_bytes(
    index: int, hashes: list[Any], chunks: Mapping[str, ChunkRecipe], where: str
) -> int:
    total = 0
    for digest in hashes:
        recipe = chunks.get(digest) if isinstance(digest, str) else None
        if recipe is None:
            raise ManifestError(f"manifest {where}: tensor {index} names unknown chunk {digest!r}")
        total += recipe.size
    return total


def _pieces(
    index: int, raw: dict[str, Any], chunks: Mapping[str, ChunkRecipe], itemsize: int, where: str
) -> tuple[PieceEntry, ...]:
    """The pieces of a sharded tensor entry: well-typed, each one's chunks holding its bytes,
    together tiling the global tensor exactly."""
    shape, listed = raw["shape"], raw["pieces"]
    if not isinstance(listed, list):
        raise ManifestError(f"manifest {where}: tensor {index} has a malformed piece list")
    pieces = []
    for number, piece in enumerate(listed):
        if not isinstance(piece, dict):
            raise ManifestError(f"manifest {where}: piece {number} of tensor {index} is malformed")
        offsets, sizes, hashes = piece.get("offsets"), piece.get("sizes"), piece.get("chunks")
        if (
            not isinstance(offsets, list)
            or not isinstance(sizes, list)
            or not isinstance(hashes, list)
            or len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or not all(_nonneg_int(v) for v in offsets + sizes)
        ):
            raise ManifestError(
                f"manifest {where}: piece {number} of tensor {index} needs {len(shape)} "
                "offsets and sizes (ints >= 0) and a chunk list"
            )
        if _chunk_bytes(index, hashes, chunks, where) != math.prod(sizes) * itemsize:
            raise ManifestError(
                f"manifest {where}: piece {number} of tensor {index} ({sizes} at {offsets}) "
                "has chunks of another size than its elements"
            )
        pieces.append(PieceEntry(tuple(offsets), tuple(sizes), tuple(hashes)))
    try:
        check_tiling(shape, [p.box for p in pieces])
    except ValueError as exc:
        raise ManifestError(
            f"manifest {where}: the pieces of tensor {raw['path']} do not tile its shape "
            f"{shape}: {exc}"
        ) from exc
    return tuple(pieces)


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


def packs_of(manifests: Iterable[Manifest]) -> set[str]:
    """Every object the given manifests name."""
    return {path for m in manifests for path in m.packs}
