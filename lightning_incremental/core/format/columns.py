"""A compact manifest's tables read column by column: the typed manifest built straight from the
columns, each check made once over a whole column.

Expanding the tables to the JSON form and validating that entry by entry
(:func:`~lightning_incremental.core.format.validation.parse`) makes a dictionary and a dozen
checks per tensor and per chunk: at 20,000 tensors that was most of the check every commit
makes of its own manifest (:func:`~lightning_incremental.core.format.canonical.seal`), and of a
restore's reading of it. Here a column's types are checked by one pass over it (``map`` and a
set), its ranges by ``min``/``max`` or numpy, and the records are made in one pass.

This path only ever accepts: it covers the common manifest — lossless chunks, no sharded
tensors, every column as long as its table — and declines (returns None) anything else, which
:func:`~lightning_incremental.core.format.compact.read` then expands and validates the full way,
which names the problem. Everything it accepts, the full way accepts as the same manifest (a
test holds the two to that).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.format.layout import MAX_CHUNK_SIZE
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry
from lightning_incremental.core.format.validation import _HASH, _itemsize, parse

_CHUNK = ("pack", "base", "offset", "length", "size", "width", "kind", "depth", "chain")
_TENSOR = ("path", "dtype", "shape", "nbytes", "width", "device", "numpy", "param")
_TENSOR_ALL = (*_TENSOR, "requires_grad", "chunks")
_INT, _STR, _LIST = {int}, {str}, {list}
_WIDTHS = {1, 2, 4, 8}
# Taken here: sizes a float64 holds exactly (the chunk bytes are summed as floats), shapes of up
# to as many dimensions as numpy allows, so that the product of a shape is a few multiplications
_EXACT = 1 << 53
_DIMS = 64


def manifest(
    header: Mapping[str, Any],
    tables: Mapping[str, Any],
    where: str,
    skeleton: Any,
) -> Manifest | None:
    """The manifest of a compact object (``header``) and its decoded ``tables``, or None where
    this path does not decide (see the module's documentation). ``skeleton(header, tables)``:
    the JSON form of the manifest from tables whose chunk and tensor columns are empty (what
    the fields outside those tables are checked on)."""
    try:
        return _manifest(header, tables, where, skeleton)
    except Exception:  # anything unexpected: the full way decides, and names it
        return None


def _types(column: list[Any], allowed: set[type]) -> bool:
    return set(map(type, column)) <= allowed


def _manifest(
    header: Mapping[str, Any], tables: Mapping[str, Any], where: str, skeleton: Any
) -> Manifest | None:
    c, t = tables["chunks"], tables["tensors"]
    if type(c) is not dict or type(t) is not dict or c.get("decoded") != {}:
        return None  # a lossy chunk (its decoded hash): the full way
    if t.get("pieces") != {}:
        return None  # sharded tensors: the full way
    digests = c["hash"]
    n = len(digests) if type(digests) is list else -1
    chunk = {name: c.get(name) for name in _CHUNK}
    if n < 0 or not all(type(v) is list and len(v) == n for v in chunk.values()):
        return None
    empty_chunks = {"hash": [], "decoded": {}, **{name: [] for name in _CHUNK}}
    empty_tensors = {"pieces": {}, **{name: [] for name in _TENSOR_ALL}}
    outer = parse(
        skeleton(header, {**tables, "chunks": empty_chunks, "tensors": empty_tensors}), where
    )
    pack_names = [str(path) for path, _ in tables["packs"]]
    sizes_of = [outer.packs[name] for name in pack_names]
    if not (_types(digests, _STR) and all(map(_HASH.match, digests)) and len(set(digests)) == n):
        return None
    ints = [chunk[name] for name in _CHUNK if name != "kind"]
    if not all(_types(column, _INT) for column in ints) or not _types(chunk["kind"], _STR):
        return None
    if n:
        pack, base, offset, length, size, depth, chain = (
            np.asarray(chunk[name], dtype=np.int64)
            for name in ("pack", "base", "offset", "length", "size", "depth", "chain")
        )
        if min(pack.min(), offset.min(), length.min(), size.min(), depth.min(), chain.min()) < 0:
            return None
        if base.min() < -1 or base.max() >= n or pack.max() >= len(pack_names):
            return None
        if size.max() > MAX_CHUNK_SIZE or not set(chunk["width"]) <= _WIDTHS:
            return None
        kinds = {kind: codecs.get(kind) for kind in set(chunk["kind"])}  # ValueError: declined
        if not all(codec.lossless for codec in kinds.values()):
            return None
        needs = np.fromiter((kinds[k].needs_base for k in chunk["kind"]), dtype=bool, count=n)
        has = base >= 0
        if (needs != has).any() or (depth[~has] != 0).any():
            return None
        if (offset + length > np.asarray(sizes_of, dtype=np.int64)[pack]).any():
            return None
        of = base[has]
        if (depth[of] != depth[has] - 1).any() or (size[of] != size[has]).any():
            return None
    tensor = {name: t.get(name) for name in _TENSOR_ALL}
    m = len(tensor["path"]) if type(tensor["path"]) is list else -1
    if m < 0 or not all(type(v) is list and len(v) == m for v in tensor.values()):
        return None
    listed, shapes = tensor["chunks"], tensor["shape"]
    if not (
        all(_types(tensor[name], _STR) for name in ("path", "dtype", "device"))
        and _types(tensor["nbytes"], _INT)
        and _types(tensor["width"], _INT)
        and set(tensor["width"]) <= _WIDTHS
        and _types(shapes, _LIST)
        and _types(listed, _LIST)
        and all(_types(tensor[f], _INT) and set(tensor[f]) <= {0, 1} for f in _FLAGS)
    ):
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    used = list(itertools.chain.from_iterable(listed))
    if not (_types(dims, _INT) and _types(used, _INT)):
        return None
    if (dims and min(dims) < 0) or (used and (min(used) < 0 or max(used) >= n)):
        return None
    nbytes: list[int] = cast(list, tensor["nbytes"])
    if m and (min(nbytes) < 0 or max(nbytes) > _EXACT or max(map(len, cast(list, shapes))) > _DIMS):
        return None  # the full way, whose products stop at the tensor's bytes
    if dims and max(dims) > _EXACT:
        return None
    itemsizes: dict[tuple[str, int], int] = {}
    for key in set(zip(tensor["dtype"], tensor["numpy"])):
        itemsizes[key] = _itemsize(key[0], bool(key[1]), where)  # ManifestError: declined
    counts = list(map(math.prod, shapes))
    if any(
        count * itemsizes[key] != total
        for count, key, total in zip(counts, zip(tensor["dtype"], tensor["numpy"]), nbytes)
    ):
        return None
    if m:
        owner = np.repeat(np.arange(m), np.fromiter(map(len, listed), dtype=np.int64, count=m))
        held = np.bincount(owner, weights=size[used] if n else None, minlength=m)
        if (held != np.asarray(nbytes, dtype=np.float64)).any():
            return None
    recipes = map(
        ChunkRecipe,
        chunk["kind"],
        [pack_names[p] for p in chunk["pack"]],
        chunk["offset"],
        chunk["length"],
        chunk["size"],
        chunk["width"],
        [digests[b] if b >= 0 else None for b in chunk["base"]],
        chunk["depth"],
        chunk["chain"],
    )
    entries = map(
        TensorEntry,
        tensor["path"],
        tensor["dtype"],
        map(tuple, shapes),
        nbytes,
        tensor["width"],
        tensor["device"],
        map(bool, tensor["numpy"]),
        map(bool, tensor["param"]),
        map(bool, tensor["requires_grad"]),
        [tuple(map(digests.__getitem__, own)) for own in listed],
    )
    return dataclasses.replace(outer, tensors=tuple(entries), chunks=dict(zip(digests, recipes)))


_FLAGS = ("numpy", "param", "requires_grad")
