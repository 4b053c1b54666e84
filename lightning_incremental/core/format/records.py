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

The pieces must tile the tensor exactly
(:func:`~lightning_incremental.core.format.pieces.check_tiling`). A manifest is written with the
least version that holds it: 1 without lossy chunks or pieces, so every reader reads what an
older writer wrote and what a non-sharded save writes. Version 4 is the same content in a compact
form, for manifests of many tensors (:mod:`~lightning_incremental.core.format.compact`).

Parsing validates everything a reader relies on (types, object paths inside the store, recipe
closure, sizes, known codecs) and rejects anything else with a :class:`ManifestError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_incremental.core.format.layout import FORMAT
from lightning_incremental.core.format.pieces import Box
from lightning_incremental.core.format.tree import piece_key

VERSION = 4  # the newest format version this library reads and writes
LOSSLESS_VERSION = 1  # what a manifest without lossy chunks or pieces is written as
LOSSY_VERSION = 2  # the first version with lossy chunks
PIECES_VERSION = 3  # the first version with sharded tensors (pieces)
COMPACT_VERSION = 4  # the compact form of a manifest of many tensors (format/compact.py)


def _plain_init(cls: type) -> type:
    """``cls`` (a frozen dataclass) with an ``__init__`` that fills the instance's dictionary
    directly, where the generated one calls ``object.__setattr__`` once per field.

    A frozen dataclass pays that to make its ``__setattr__`` refuse (the dataclasses
    documentation calls it a performance penalty): 1.1 us for a chunk recipe against 0.4 us
    here, and a commit builds two records per tensor and per chunk (its manifest, then the
    manifest read back from its bytes), tens of thousands at tens of thousands of tensors.
    The instance is the same — the same fields and defaults, frozen once made, equal and hashed
    alike (a test holds the two constructors to that) — and ``dataclasses.replace`` goes
    through this ``__init__`` too. For classes without ``__post_init__``, default factories or
    slots."""
    fields = dataclasses.fields(cls)
    plain = all(
        f.default_factory is dataclasses.MISSING and f.init and not f.kw_only for f in fields
    )
    if not plain or hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        raise TypeError(f"{cls.__name__}: _plain_init does not cover its fields")
    defaults: dict[str, Any] = {}
    params = []
    for f in fields:
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    # the instance and its dictionary under names no field can have (dataclasses' own habit)
    body = "".join(f"    __dataclass_dict__[{f.name!r}] = {f.name}\n" for f in fields)
    source = (
        f"def __init__(__dataclass_self__, {', '.join(params)}):\n"
        f"    __dataclass_dict__ = __dataclass_self__.__dict__\n{body}"
    )
    namespace: dict[str, Any] = {}
    exec(source, defaults, namespace)  # the names: our own classes' fields
    init = namespace["__init__"]
    generated = cls.__init__
    init.__qualname__, init.__module__ = generated.__qualname__, generated.__module__
    init.__doc__, init.__annotations__ = generated.__doc__, dict(generated.__annotations__)
    cls.__init__ = init  # type: ignore[misc]
    return cls


@_plain_init
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


@_plain_init
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


@_plain_init
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
        by :func:`~lightning_incremental.core.format.tree.piece_key` (how a rank finds its own
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
        tree: the skeleton of the state (see :mod:`~lightning_incremental.core.format.tree`).
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


def packs_of(manifests: Iterable[Manifest]) -> set[str]:
    """Every object the given manifests name."""
    return {path for m in manifests for path in m.packs}
