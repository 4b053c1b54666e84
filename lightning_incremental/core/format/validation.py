"""The manifest validator: a typed :class:`~lightning_incremental.core.format.records.Manifest`
from a JSON object, or a :class:`ManifestError` naming the first problem.

Everything a reader relies on is checked: types, object paths inside the store, recipe closure
and sizes, chunk kinds known to the codec registry, pieces that tile their tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import HASH_LEN
from lightning_incremental.core.errors import FormatVersionError, ManifestError
from lightning_incremental.core.format.layout import FORMAT, MAX_CHUNK_SIZE, MAX_STEP, PACK_DIR
from lightning_incremental.core.format.pieces import check_tiling
from lightning_incremental.core.format.records import (
    LOSSY_VERSION,
    PIECES_VERSION,
    VERSION,
    ChunkRecipe,
    Manifest,
    PieceEntry,
    TensorEntry,
)
from lightning_incremental.core.format.tree import torch_dtype

_HASH = re.compile(rf"^[0-9a-f]{{{HASH_LEN}}}$")

_PACK = re.compile(rf"^{PACK_DIR}/[0-9a-f]{{2}}/[0-9a-f]{{{HASH_LEN}}}\.pack$")

_FIELDS = (  # the top-level fields a manifest holds, every other key is kept as ``extra``
    "format", "version", "step", "parent", "generation", "since_base", "chunk_size", "created",
    "audit", "stats", "pickled", "tree", "tensors", "chunks", "packs",
)  # fmt: skip


def check_version(doc: dict[str, Any], where: str) -> int:
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


def parse(doc: Mapping[str, Any], where: str) -> Manifest:
    """The typed manifest of a JSON object (checksum already removed), validated: types, object
    paths, recipe closure and sizes, codecs known to the registry.

    Raises:
        FormatVersionError: a newer format version. ManifestError: naming the first problem.
    """
    version = check_version(dict(doc), where)
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
    kinds: dict[Any, Any] = {}
    chunks = {d: _recipe_fast(d, r, packs, kinds, version, where) for d, r in raw_chunks.items()}
    for digest, recipe in chunks.items():
        if recipe.base is not None:
            _check_base(digest, recipe, chunks, where)
    sizes: dict[tuple[Any, Any], int] = {}
    tensors = tuple(
        _tensor_fast(i, t, chunks, sizes, version, where) for i, t in enumerate(doc["tensors"])
    )
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


# Fast paths: a manifest of 100,000 tensors is parsed entry by entry, and checked that way on
# every commit (canonical.seal). Each fast path accepts only what its full check accepts (the
# common case, tested with plain type checks, each pack path and codec looked up once per
# manifest) and hands anything else to the full check, which names the problem.


def _recipe_fast(
    digest: Any,
    raw: Any,
    packs: Mapping[str, int],
    kinds: dict[Any, Any],
    version: int,
    where: str,
) -> ChunkRecipe:
    if type(digest) is str and type(raw) is dict and _HASH.match(digest):
        get = raw.get
        pack, offset, length, size = get("pack"), get("offset"), get("length"), get("size")
        width, depth, chain, base = get("width"), get("depth"), get("chain"), get("base")
        kind = get("kind")
        codec = kinds.get(kind) if type(kind) is str else None
        if codec is None and type(kind) is str:
            try:
                codec = kinds[kind] = codecs.get(kind)
            except ValueError:
                codec = None  # the full check names it
        if (
            codec is not None
            and codec.lossless
            and get("lossless", True) is True
            and get("decoded") is None
            and type(pack) is str
            and pack in packs  # every listed pack's path was checked (_pack_size)
            and type(offset) is int
            and type(length) is int
            and type(size) is int
            and type(depth) is int
            and type(chain) is int
            and type(width) is int
            and width in (1, 2, 4, 8)
            and min(offset, length, size, depth, chain) >= 0
            and size <= MAX_CHUNK_SIZE
            and offset + length <= packs[pack]
            and (type(base) is str if codec.needs_base else base is None and depth == 0)
        ):
            return ChunkRecipe(
                kind=codec.kind, pack=pack, offset=offset, length=length, size=size,
                width=width, base=base, depth=depth, chain=chain,
            )  # fmt: skip
    return _recipe(digest, raw, packs, version, where)


def _tensor_fast(
    index: int,
    raw: Any,
    chunks: Mapping[str, ChunkRecipe],
    sizes: dict[tuple[Any, Any], int],
    version: int,
    where: str,
) -> TensorEntry:
    if type(raw) is dict and "pieces" not in raw:
        get = raw.get
        shape, hashes, nbytes, dtype, numpy = (
            get("shape"), get("chunks"), get("nbytes"), get("dtype"), get("numpy"),
        )  # fmt: skip
        path, width, device = get("path"), get("width"), get("device")
        param, requires_grad = get("param"), get("requires_grad")
        total, count = 0, 1
        good = (
            type(shape) is list
            and type(hashes) is list
            and type(nbytes) is int
            and nbytes >= 0
            and type(path) is str
            and type(dtype) is str
            and type(device) is str
            and type(width) is int
            and width in (1, 2, 4, 8)
            and type(param) is bool
            and type(requires_grad) is bool
            and type(numpy) is bool
        )
        if good:
            most = nbytes if type(nbytes) is int else 0
            for d in shape:
                if type(d) is not int or d < 0:
                    good = False
                    break
                count *= d
                if count > most:  # more elements than bytes, or a 0 later: the full check
                    good = False
                    break
            for digest in hashes:
                recipe = chunks.get(digest) if type(digest) is str else None
                if recipe is None:
                    good = False
                    break
                total += recipe.size
        if good:
            itemsize = sizes.get((dtype, numpy))
            if itemsize is None:
                itemsize = sizes[(dtype, numpy)] = _itemsize(dtype, numpy, where)
            if total == nbytes and count * itemsize == nbytes:
                return TensorEntry(
                    path=path, dtype=dtype, shape=tuple(shape), nbytes=nbytes, width=width,
                    device=device, numpy=numpy, param=param, requires_grad=requires_grad,
                    chunks=tuple(hashes),
                )  # fmt: skip
    return _tensor(index, raw, chunks, version, where)


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
    elements = element_count(shape, raw["nbytes"])  # -1: more than its bytes hold
    pieces = None
    if "pieces" in raw:
        if version < PIECES_VERSION or "chunks" in raw or raw.get("numpy") is not False:
            raise ManifestError(
                f"manifest {where}: tensor {index} has pieces, which need format version "
                f"{PIECES_VERSION}, no chunk list of its own, and a torch dtype"
            )
        if elements < 0:
            raise _wrong_size(raw, where)
        pieces = _pieces(index, raw, chunks, itemsize, elements, where)
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
    if elements * itemsize != raw["nbytes"]:
        raise _wrong_size(raw, where)
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


def _wrong_size(raw: dict[str, Any], where: str) -> ManifestError:
    return ManifestError(
        f"manifest {where}: tensor {raw['path']} has the wrong size: shape {raw['shape']!s:.200} "
        f"of {raw['dtype']} does not hold {raw['nbytes']} bytes"
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


def element_count(shape: list[int], most: int) -> int:
    """The number of elements of ``shape`` (non-negative ints), or -1 when that is more than
    ``most``. Multiplied only while the product stays at most ``most``: a forged shape of many
    or huge dimensions costs a pass over it, where its full product would grow with every
    factor (quadratic time in the shape's length)."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > most:
            return -1
    return count


def _pieces(
    index: int,
    raw: dict[str, Any],
    chunks: Mapping[str, ChunkRecipe],
    itemsize: int,
    elements: int,
    where: str,
) -> tuple[PieceEntry, ...]:
    """The pieces of a sharded tensor entry (of ``elements`` elements): well-typed, each one's
    chunks holding its bytes, together tiling the global tensor exactly."""
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
        held = element_count(sizes, elements)
        if held < 0:
            raise ManifestError(
                f"manifest {where}: piece {number} of tensor {index} ({sizes!s:.200}) holds "
                f"more elements than its tensor ({elements})"
            )
        if _chunk_bytes(index, hashes, chunks, where) != held * itemsize:
            raise ManifestError(
                f"manifest {where}: piece {number} of tensor {index} ({sizes!s:.200} at "
                f"{offsets!s:.200}) has chunks of another size than its elements"
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
