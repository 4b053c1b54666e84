"""What a restore decodes, and into what: a whole checkpoint, a part of it (``keys``), into new
tensors or into the caller's own (``into``).

Loading into existing tensors is how a training job restores without a second copy of its state:
each chunk is decoded straight into the memory of the model's parameters and buffers (host
tensors), or through one chunk of scratch memory into a device tensor. Shapes and dtypes are
checked for every tensor before anything is read, so a checkpoint of another model fails with an
error naming the key and leaves the caller's tensors untouched. So is aliasing: two tensors of
the checkpoint are never decoded into overlapping memory of ``into`` (tied weights the checkpoint
holds apart), which would mix their bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.errors import ConfigError, CorruptCheckpointError
from lightning_incremental.core.format.pieces import describe, global_shape, sharded_kind, whole
from lightning_incremental.core.format.records import Manifest, TensorEntry
from lightning_incremental.core.format.tree import (
    T_DICT,
    T_FROZENSET,
    T_LIST,
    T_ODICT,
    T_ODICT_META,
    T_SET,
    T_TENSOR,
    T_TUPLE,
    key_path,
    torch_dtype,
)
from lightning_incremental.core.load.materialise import allocate
from lightning_incremental.core.load.targets import Regions, Staged, Target


def check_keys(keys: Any) -> tuple[str, ...] | None:
    """``keys`` as a tuple of top-level keys (None: everything).

    Raises:
        TypeError: not a str or an iterable of str.
    """
    if keys is None:
        return None
    if isinstance(keys, str):
        return (keys,)
    if isinstance(keys, Iterable) and not isinstance(keys, (bytes, Mapping)):
        out = tuple(keys)
        if out and all(isinstance(k, str) for k in out):
            return out
    raise TypeError(f"keys must be a top-level key or a list of them (str), got {keys!r:.80}")


def prune(skeleton: Any, keys: tuple[str, ...] | None, where: str) -> tuple[Any, set[int] | None]:
    """The skeleton of the top-level ``keys`` only, and the indices of the tensors it uses (None:
    all of them).

    Raises:
        ConfigError: a key the checkpoint does not have (naming the ones it has).
    """
    if keys is None:
        return skeleton, None
    tag, items = skeleton
    if tag not in (T_DICT, T_ODICT):
        raise ConfigError(f"checkpoint {where} is not a dict of keys; load it whole")
    present = [k for k, _ in items if isinstance(k, str)]
    missing = [k for k in keys if k not in present]
    if missing:
        raise ConfigError(
            f"checkpoint {where} has no top-level key {', '.join(map(repr, missing))}; its keys "
            f"are {', '.join(map(repr, present))}"
        )
    kept = [[k, v] for k, v in items if k in keys]
    wanted: set[int] = set()
    for _, value in kept:
        _tensor_indices(value, wanted)
    return [tag, kept], wanted


def _tensor_indices(node: Any, found: set[int]) -> None:
    """Every tensor index a (validated) skeleton node refers to."""
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        return
    tag, payload = node
    if tag == T_TENSOR:
        found.add(int(payload))
    elif tag in (T_LIST, T_TUPLE, T_SET, T_FROZENSET):
        for child in payload:
            _tensor_indices(child, found)
    elif tag in (T_DICT, T_ODICT):
        for key, value in payload:
            _tensor_indices(key, found)
            _tensor_indices(value, found)
    elif tag == T_ODICT_META:
        items, meta = payload
        _tensor_indices([T_DICT, items], found)
        _tensor_indices(meta, found)


def tensors_of(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested state by the key path a checkpoint records for them."""
    found: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(key_path(path), value)
        elif isinstance(value, Mapping):
            for key, child in value.items():
                walk(child, (*path, key))
        elif isinstance(value, (list, tuple)):
            for index, child in enumerate(value):
                walk(child, (*path, index))

    walk(state, ())
    return found


@dataclass
class Destinations:
    """Where each tensor of a manifest is decoded: ``holders[i]`` is what ``load`` returns for
    tensor ``i`` once decoded (None: not restored), ``inplace[i]`` whether it is the caller's
    own tensor (returned as it is), ``after`` copies to run once decoding is over."""

    holders: list[Any]
    inplace: list[bool]
    after: list[tuple[np.ndarray, torch.Tensor]]


def plan(
    manifest: Manifest,
    wanted: set[int] | None,
    into: Any,
    where: str,
    *,
    strict: bool = True,
) -> tuple[Destinations, list[Target]]:
    """Decide every tensor's destination (checking ``into``'s tensors first) and allocate what
    is not the caller's.

    Raises:
        ConfigError: with ``strict``, an ``into`` tensor whose shape or dtype differs from the
            checkpoint's (or a numpy array in the checkpoint where ``into`` has a tensor),
            naming its key. Without ``strict`` such a tensor is restored as a new one (for a
            caller that reports mismatches its own way, e.g. ``load_state_dict``). In either
            mode: two ``into`` tensors that share memory and would receive two different
            tensors of the checkpoint (see :func:`check_disjoint`), naming both keys.
    """
    entries = manifest.tensors
    mine = tensors_of(into) if into is not None else {}
    chosen: list[torch.Tensor | None] = []
    for index, entry in enumerate(entries):
        target = mine.get(entry.path) if (wanted is None or index in wanted) else None
        if target is not None:
            try:
                _check_target(target, entry, where)
            except ConfigError:
                if strict:
                    raise
                target = None
        chosen.append(target)
    check_disjoint(entries, chosen, where)
    holders: list[Any] = []
    inplace: list[bool] = []
    after: list[tuple[np.ndarray, torch.Tensor]] = []
    targets: list[Target] = []
    for index, (entry, target) in enumerate(zip(entries, chosen)):
        if wanted is not None and index not in wanted:
            holders.append(None)
            inplace.append(False)
            targets.append(None)
        elif target is None:
            holder, raw = allocating(entry, where, allocate)
            holders.append(holder)
            inplace.append(False)
            targets.append(raw)
        elif sharded_kind(target) is not None or entry.pieces is not None:
            holders.append(target)
            inplace.append(True)
            targets.append(_regions(target, entry))
        else:
            holders.append(target)
            inplace.append(True)
            targets.append(_into(target, entry, after))
    return Destinations(holders, inplace, after), targets


def check_disjoint(
    entries: Sequence[TensorEntry], chosen: Sequence[torch.Tensor | None], where: str
) -> None:
    """Check that no two tensors of the checkpoint are decoded into overlapping memory:
    ``chosen[i]`` is the ``into`` tensor that ``entries[i]`` is restored into (None: none).

    Their chunks are decoded concurrently, straight into that memory: two of them sharing bytes
    (tied weights in the model that the checkpoint holds as two tensors, overlapping views of
    one storage, two arrays over one buffer) would restore a mix of both — and a chunk checked
    while the other overwrites it reads as corrupt. A checkpoint that holds one tensor under
    two keys (tied when saved) has one entry for both: nothing to check. Two entries of the
    same chunks restored into the same view (tied destinations, equal values saved apart) write
    the same bytes, each chunk by one decode (see ``decoder.restore_chunks``): allowed. Overlap
    is found in memory, per device, from each destination's byte range (see :func:`_extents`),
    sorted: O(n log n) in the number of destinations.

    Raises:
        ConfigError: naming both key paths, before anything is read.
    """
    ranges: dict[torch.device, list[tuple[int, int, int]]] = defaultdict(list)
    same: dict[tuple[Any, ...], int] = {}  # a view and the chunks it gets -> its first entry
    for index, target in enumerate(chosen):
        if target is None:
            continue
        entry = entries[index]
        if entry.pieces is None and sharded_kind(target) is None and target.numel():
            view = (target.device, target.data_ptr(), target.dtype, target.shape, target.stride())
            first = same.setdefault((*view, entry.chunks), index)
            if first != index:
                continue  # the same bytes, into the same place, as entry ``first``
        for device, start, end in _extents(target):
            ranges[device].append((start, end, index))
    for spans in ranges.values():
        spans.sort()
        # The two furthest-reaching ranges seen so far, of two different tensors: (end, index).
        # Pieces of one sharded tensor may share memory (replicas); only two tensors clash.
        best, second = (-1, -1), (-1, -1)
        for start, end, index in spans:
            reach, other = best if best[1] != index else second
            if reach > start:
                one, two = sorted((other, index))
                raise ConfigError(
                    f"{entries[one].path} and {entries[two].path} are two tensors in "
                    f"checkpoint {where}, but their tensors in `into` overlap in memory (tied "
                    "weights, or views of one storage): restoring both would mix their bytes. "
                    "Untie them before loading (and tie them again after), leave one of them out "
                    "of `into` (it is then returned as a new tensor), or load without `into`"
                )
            if index == best[1]:
                best = (max(best[0], end), index)
            elif end > best[0]:
                best, second = (end, index), best
            elif end > second[0]:
                second = (end, index)


def _extents(target: torch.Tensor) -> list[tuple[torch.device, int, int]]:
    """The memory a restore writes into ``target``: ``(device, first byte, last byte + 1)``
    address ranges, one per local piece of a sharded tensor (the whole of a plain tensor), none
    when empty.

    Conservative: a range runs from a view's first byte to its last whatever its strides, so two
    views that interleave without sharing a byte (``w[:, :2]`` and ``w[:, 2:]``) count as
    overlapping. Addresses, not storages: two tensors over one buffer with storages of their own
    (``torch.from_numpy`` of two views of one array) are found too."""
    if sharded_kind(target) is not None:
        pieces = [piece.tensor for piece in describe(target)]
    else:
        pieces = [target]
    out = []
    for piece in pieces:
        if piece.numel() == 0 or piece.device.type == "meta":
            continue
        last = sum((n - 1) * stride for n, stride in zip(piece.shape, piece.stride()))
        start = piece.data_ptr()
        out.append((piece.device, start, start + (last + 1) * piece.element_size()))
    return out


def allocating(
    entry: TensorEntry, where: str, allocate: Callable[[TensorEntry], tuple[Any, Any]]
) -> tuple[Any, Any]:
    """``allocate(entry)``, with an allocation failure as the checkpoint's error (a load then
    falls back) rather than the allocator's.

    Raises:
        CorruptCheckpointError: the tensor cannot be allocated.
    """
    try:
        return allocate(entry)
    except (MemoryError, RuntimeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint {where}: tensor {entry.path} of shape {list(entry.shape)} needs "
            f"{entry.nbytes} bytes, which cannot be allocated ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the manifest is damaged or hostile, or this machine has too "
            "little memory for it"
        ) from exc


def _regions(target: torch.Tensor, entry: TensorEntry) -> Regions:
    """The boxes of ``target`` to fill: a sharded tensor's local pieces (replicas included), or
    the whole of a plain tensor."""
    if sharded_kind(target) is not None:
        return Regions(tuple((p.tensor, p.box) for p in describe(target)))
    return Regions(((target.detach(), whole(entry.shape)),))


def _check_target(target: torch.Tensor, entry: TensorEntry, where: str) -> None:
    path = entry.path
    if entry.numpy:
        raise ConfigError(
            f"{path} is a numpy array in checkpoint {where} but a tensor in `into`; leave it out "
            "of `into`"
        )
    dtype = torch_dtype(entry.dtype)
    shape = global_shape(target)
    if target.dtype != dtype or list(shape) != list(entry.shape):
        raise ConfigError(
            f"{path} is {dtype} {list(entry.shape)} in checkpoint {where} but "
            f"{target.dtype} {list(shape)} in `into`: this checkpoint is not for this "
            "model (or load it without `into`)"
        )


def _into(target: torch.Tensor, entry: TensorEntry, after: list[Any]) -> Target:
    """The decoding destination inside ``target``'s own memory."""
    data = target.detach()
    if entry.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    if data.is_contiguous() and not data.is_conj() and not data.is_neg():
        flat = data.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            return flat.numpy()

        def put(offset: int, chunk: np.ndarray) -> None:
            flat[offset : offset + chunk.size].copy_(torch.from_numpy(chunk))

        return Staged(entry.nbytes, put)
    scratch = np.empty(entry.nbytes, dtype=np.uint8)  # non-contiguous: one tensor's scratch
    after.append((scratch, data))
    return scratch


def finish_inplace(destinations: Destinations) -> None:
    """The copies into non-contiguous ``into`` tensors, once their bytes are decoded."""
    for scratch, data in destinations.after:
        decoded = torch.from_numpy(scratch).view(data.dtype).reshape(data.shape)
        data.copy_(decoded)
