"""The snapshot: a state walked into the skeleton of :mod:`~.format.tree`, every tensor
copied to host memory (recycled buffers, pinned for CUDA tensors), so that training
may go on while the copy is encoded and written.

CUDA tensors are copied on a side stream of their device (:class:`_DeviceCopies`): the copies
start after the work training queued before ``save`` (the side stream waits for the current
one), training's later work waits for them on the device (the current stream waits for the side
stream: an optimizer step queued next cannot overwrite a tensor before its copy), and the host
does not wait at all — ``save`` returns once the copies are queued, and the save's background
work waits for their event before it reads the host buffers (``Flat.ready``). The source tensors
are marked used on the side stream, so the caching allocator does not reuse the memory of one
the caller frees meanwhile.

``flatten`` returns a JSON-serialisable skeleton that refers to tensors by index; values the
skeleton cannot express are an error naming their key path, unless pickling was allowed. In a
distributed save (``rank`` given) every process walks the same state and numbers the same slots;
plain tensors are identical on every rank and snapshotted by rank 0 only."""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.buffers import BufferPool, collection_paused, host_tensor
from lightning_incremental.core.codecs.bytes import group_width
from lightning_incremental.core.errors import (
    UnsupportedValueError,
)
from lightning_incremental.core.format.pieces import (
    describe,
    global_shape,
    sharded_kind,
    spans_processes,
)
from lightning_incremental.core.format.tree import (
    CONTAINERS,
    MAX_DEPTH,
    T_BIGINT,
    T_BYTES,
    T_COMPLEX,
    T_DEVICE,
    T_DICT,
    T_DTYPE,
    T_FLOAT,
    T_FROZENSET,
    T_LIST,
    T_NPSCALAR,
    T_ODICT,
    T_ODICT_META,
    T_PICKLE,
    T_SET,
    T_SIZE,
    T_TENSOR,
    T_TUPLE,
    Flat,
    Leaf,
    ShardedInfo,
    dtype_name,
    float_hex,
    key_path,
)
from lightning_incremental.core.save.slabs import NO_KEY, SLAB_MAX, Slabs, complete, full_path

# Read once: the walk tests every tensor against them (a module attribute lookup each otherwise).
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided
#: A quantized tensor has one of these dtypes (a set lookup is a third of the cost of reading
#: ``is_quantized``); a plain tensor viewed as one is refused too.
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


def _unsupported(t: torch.Tensor, path: tuple[Any, ...]) -> UnsupportedValueError:
    where = key_path(path)
    if t.layout != torch.strided:
        return UnsupportedValueError(
            f"{where} is a {t.layout} tensor; only dense (strided) tensors are supported — "
            "save t.to_dense() instead"
        )
    if t.is_meta:
        return UnsupportedValueError(f"{where} is a meta tensor and holds no data to save")
    return UnsupportedValueError(f"{where} is a quantized or nested tensor; not supported")


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    """How ``t`` sees its memory: tensors at one address that agree on this are one leaf."""
    return (
        t.device, t.dtype, tuple(t.shape), t.stride(), type(t), t.requires_grad, t.is_conj(),
        t.is_neg(),
    )  # fmt: skip


def _same_view(t: torch.Tensor, seen: list[tuple[torch.Tensor, int]]) -> int | None:
    """The slot of a tensor in ``seen`` (at ``t``'s address) that is the same view as ``t``."""
    view = _view(t)
    for other, slot in seen:
        if _view(other) == view:
            return slot
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    # isinstance(t, Parameter) runs Parameter's metaclass check in Python for every plain
    # tensor: about 10 us each, a large part of a snapshot of tens of thousands of tensors.
    # For a plain tensor it answers what this reads (a tensor marked as a parameter).
    if type(t) is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


class _Flattener:
    def __init__(self, allow_pickle: bool, pool: BufferPool | None, rank: int | None) -> None:
        self.allow_pickle = allow_pickle
        self.pool = pool
        self.rank = rank
        self.writes_plain = rank in (None, 0)  # plain tensors: rank 0 alone writes them
        self.leaves: list[Leaf] = []
        self.slots = 0
        self.sharded: dict[int, ShardedInfo] = {}
        # data address -> the tensors seen there and their slots (tensors at one address are
        # compared in full only then: most addresses hold one tensor)
        # (one pair, not a list of one: an object fewer per tensor)
        self.addresses: dict[int, Any] = {}
        self.pickled: list[str] = []
        self.cuda = _DeviceCopies()
        self.slabs = Slabs(pool)
        self.small = self.slabs.by_dtype  # dtype -> the small tensors noted (see .slabs)

    def node(self, value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common case first
            return [T_TENSOR, self.tensor(value, path)]
        if len(path) >= MAX_DEPTH and kind in CONTAINERS:
            shown = key_path(path[:6]) + "..." + "".join(f"[{k!r}]" for k in path[-3:])
            raise UnsupportedValueError(
                f"{shown} is nested {len(path)} levels deep; a checkpoint holds at most "
                f"{MAX_DEPTH} levels of dict/list/tuple (is the state a linked structure or "
                "does it contain itself?) — flatten it"
            )
        if kind is int:
            # JSON numbers past 64 bits are not portable (and Python caps int<->str at 4300
            # digits): those go as hex text, which has no such limit.
            return value if -(2**63) <= value < 2**64 else [T_BIGINT, hex(value)]
        if kind is float:
            return [T_FLOAT, float_hex(value)]
        if kind is bytes:
            return [T_BYTES, base64.b64encode(value).decode("ascii")]
        if kind is list:
            return [T_LIST, [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if kind is tuple:
            return [T_TUPLE, [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if kind is dict or kind is OrderedDict:
            items = self.items(value, path)
            metadata = getattr(value, "_metadata", None)
            if kind is OrderedDict and metadata is not None:
                # nn.Module.state_dict() keeps per-module versions here; torch.save keeps them
                return [T_ODICT_META, [items, self.node(metadata, (*path, "_metadata"))]]
            return [T_DICT if kind is dict else T_ODICT, items]
        if kind is set or kind is frozenset:
            tag = T_SET if kind is set else T_FROZENSET
            return [tag, [self.key(v, path) for v in value]]
        if kind is complex:
            return [T_COMPLEX, [float_hex(value.real), float_hex(value.imag)]]
        if kind is torch.dtype:
            return [T_DTYPE, dtype_name(value)]
        if kind is torch.device:
            return [T_DEVICE, str(value)]
        if kind is torch.Size:
            return [T_SIZE, list(value)]
        if isinstance(value, torch.Tensor) and sharded_kind(value) is not None:
            return [T_TENSOR, self.sharded_tensor(value, path)]
        if kind is np.ndarray and value.dtype.kind in "biufc" and not value.dtype.hasobject:
            return [T_TENSOR, self.ndarray(value, path)]
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            payload = base64.b64encode(value.tobytes()).decode("ascii")
            return [T_NPSCALAR, [value.dtype.str, payload]]
        return self.pickle(value, path)

    def items(self, value: dict[Any, Any], path: tuple[Any, ...]) -> list[list[Any]]:
        """``[key, node]`` of each item of a dict. A plain tensor goes straight to
        :meth:`tensor` with its parent's path and its key, not a path of its own: most values of
        a large state are tensors in dicts, and the call and the tuple cost a tenth of a walk."""
        out: list[list[Any]] = []
        append, tensor, node = out.append, self.tensor, self.node
        for k, v in value.items():
            key = k if type(k) is str else self.key(k, path)
            kind = type(v)
            if kind is _TENSOR or kind is _PARAMETER:
                append([key, [T_TENSOR, tensor(v, path, k)]])
            else:
                append([key, node(v, (*path, k))])
        return out

    def key(self, key: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(key, (torch.Tensor, np.ndarray)):
            raise UnsupportedValueError(
                f"{key_path(path)} has a {type(key).__name__} as a dict key or set member; "
                "use str or int keys"
            )
        return self.node(key, path)

    def pickle(self, value: Any, path: tuple[Any, ...]) -> Any:
        where = key_path(path)
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a "
                "checkpoint can only hold by pickling it (loading would then execute code). "
                "Convert it to plain data (dict/list/str/int/float/tensor), or open the store "
                "with allow_pickle=True if every reader trusts this checkpoint."
            )
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UnsupportedValueError(f"{where} cannot be pickled: {exc}") from exc
        self.pickled.append(where)
        return [T_PICKLE, base64.b64encode(blob).decode("ascii")]

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...], key: Any = NO_KEY) -> int:
        """The slot of tensor ``t`` at ``path`` (or at ``path`` + ``key``: see :meth:`items`)."""
        # Called for every tensor of the state: the attribute reads below are what ``save``
        # blocks for at tens of thousands of tensors, so each is read once.
        dtype, cpu = t.dtype, t.is_cpu
        if (
            t.layout is not _STRIDED
            or t.is_nested
            or dtype in _QUANTIZED
            or (not cpu and t.is_meta)  # a CPU tensor is not a meta one
        ):
            raise _unsupported(t, full_path(path, key))
        requires_grad, nbytes = t.requires_grad, t.nbytes
        slot = self.slots
        if nbytes:  # the same view of the same memory, seen the same way, is one leaf
            pair = (t, slot)
            seen = self.addresses.setdefault(t.data_ptr(), pair)
            if seen is not pair:
                if type(seen) is tuple:
                    seen = self.addresses[t.data_ptr()] = [seen]
                same = _same_view(t, seen)
                if same is not None:
                    return same
                seen.append(pair)
        self.slots = slot + 1
        if not self.writes_plain:
            return slot  # identical on every rank: rank 0 writes it
        if nbytes <= SLAB_MAX and nbytes and cpu:
            # A conjugate or negative view needs no test: torch.cat writes what it shows.
            # copied with the other small tensors of its dtype once the walk is done
            parameter = type(t) is _PARAMETER or bool(getattr(t, "_is_param", False))
            leaves = self.leaves
            shape = t.shape
            noted = (path, key, slot, len(leaves), shape, requires_grad, parameter, nbytes)
            flat = t if len(shape) == 1 else t.reshape(-1)  # what torch.cat takes
            group = self.small.get(dtype)
            if group is None:
                self.small[dtype] = ([flat], [noted])
            else:
                group[0].append(flat)
                notes = group[1]
                notes.append(noted)
                if len(notes) >= self.slabs.limit:  # copied on another thread meanwhile
                    self.slabs.hand_off(dtype)
            leaves.append(None)  # type: ignore[arg-type]  # built by slabs.complete
            return slot
        where = key_path(full_path(path, key))
        self.leaves.append(self.snapshot(t, where, slot))
        return slot

    def _slot(self) -> int:
        slot = self.slots
        self.slots += 1
        return slot

    def _copy(self, src: torch.Tensor) -> torch.Tensor:
        on_cuda = src.device.type == "cuda"
        pin = on_cuda and torch.cuda.is_available()
        if self.pool is not None:
            data = self.pool.take(src.shape, src.dtype, pin=pin)
        else:
            data = host_tensor(src.shape, src.dtype, pin=pin)
        if on_cuda:
            self.cuda.copy(data, src)
        else:
            data.copy_(src)
        return data

    def snapshot(self, t: torch.Tensor, where: str, slot: int) -> Leaf:
        src = t.detach()
        if src.is_conj():
            src = src.resolve_conj()
        if src.is_neg():
            src = src.resolve_neg()
        return Leaf(
            path=where,
            data=self._copy(src),
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            device=str(t.device),
            width=group_width(t.element_size(), t.is_complex()),
            parameter=_is_parameter(t),
            requires_grad=bool(t.requires_grad),
            slot=slot,
        )

    def sharded_tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        """Snapshot the pieces of a DTensor / ShardedTensor this process writes (copies: the
        local shard is a view of the live parameter)."""
        where = key_path(path)
        processes = spans_processes(t)
        if self.rank is None and processes > 1:
            raise UnsupportedValueError(
                f"{where} is a {type(t).__name__} sharded over {processes} processes; this "
                "process holds only its own shard. Open the store with distributed=True on "
                "every rank and call save on every rank (or save t.full_tensor())"
            )
        try:
            pieces = describe(t)
        except ValueError as exc:
            raise UnsupportedValueError(f"{where}: {exc}") from exc
        slot = self._slot()
        local = pieces[0].tensor if pieces else None
        self.sharded[slot] = ShardedInfo(
            path=where,
            dtype=dtype_name(t.dtype),
            shape=global_shape(t),
            device=str(local.device if local is not None else t.device),
            width=group_width(t.dtype.itemsize, t.dtype.is_complex),
            parameter=_is_parameter(t),
            requires_grad=bool(t.requires_grad),
        )
        for piece in pieces:
            if not piece.write:
                continue
            src = piece.tensor.detach()
            if src.is_conj():
                src = src.resolve_conj()
            if src.is_neg():
                src = src.resolve_neg()
            self.leaves.append(
                Leaf(
                    path=where,
                    data=self._copy(src),
                    dtype=dtype_name(t.dtype),
                    shape=list(piece.box.sizes),
                    device=str(src.device),
                    width=group_width(t.dtype.itemsize, t.dtype.is_complex),
                    slot=slot,
                    offsets=piece.box.offsets,
                )
            )
        return slot

    def ndarray(self, a: np.ndarray, path: tuple[Any, ...]) -> int:
        slot = self._slot()
        if self.rank not in (None, 0):
            return slot
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy()
        self.leaves.append(
            Leaf(
                path=key_path(path),
                data=torch.from_numpy(flat),
                dtype=a.dtype.str,
                shape=list(a.shape),
                device="cpu",
                is_numpy=True,
                slot=slot,
            )
        )
        return slot


def flatten(
    state: Any, *, allow_pickle: bool = False, pool: BufferPool | None = None
) -> tuple[Any, list[Leaf], list[str]]:
    """Snapshot ``state``: its JSON skeleton, its arrays copied to host memory, and the key paths
    of pickled values. Tensors that are the same view of the same storage become one leaf.
    Snapshot buffers come from ``pool`` when given (recycled from earlier snapshots). A sharded
    tensor becomes its pieces (see :func:`flatten_state`).

    Raises:
        UnsupportedValueError: a value the skeleton cannot express, naming its key path.
    """
    flat = flatten_state(state, allow_pickle=allow_pickle, pool=pool)
    wait_ready(flat)
    return flat.skeleton, flat.leaves, flat.pickled


def flatten_state(
    state: Any,
    *,
    allow_pickle: bool = False,
    pool: BufferPool | None = None,
    rank: int | None = None,
) -> Flat:
    """Snapshot ``state`` (see :func:`flatten`) with what a sharded save needs to know.

    Args:
        rank: None in a single process: every tensor is snapshotted, and a sharded tensor spread
            over several processes is an error. In a distributed save, this process's global
            rank: each rank snapshots the pieces of sharded tensors it writes (one of each set of
            replicas), and rank 0 alone the plain tensors and arrays.

    Raises:
        UnsupportedValueError: a value the skeleton cannot express, naming its key path.
    """
    flattener = _Flattener(allow_pickle, pool, rank)
    # The walk makes a few small objects per tensor, none of them garbage; the collections they
    # would trigger only scan them again and again (half the walk's time at 20,000 tensors).
    # Out of inference mode (Lightning's validation loop saves in it): a buffer or a view of
    # one made in it is an inference tensor, which later saves outside it, and the copying
    # thread, could not write into (the buffers are recycled from save to save).
    with collection_paused(), torch.inference_mode(False):
        try:
            try:
                skeleton = flattener.node(state, ())
            finally:
                ready = flattener.cuda.finish()  # also when the walk failed: none unordered
        except BaseException:
            flattener.slabs.abandon()  # batches handed to the copying thread: their slabs back
            raise
        flattener.slabs.copy()
    slabs = flattener.slabs
    return Flat(
        skeleton, flattener.leaves, flattener.pickled, flattener.slots, flattener.sharded,
        ready=ready, finish=(lambda leaves: complete(slabs, leaves)) if slabs.copied else None,
    )  # fmt: skip


class _DeviceCopies:
    """Device-to-host copies on one side stream per CUDA device (see the module
    documentation)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def copy(self, data: torch.Tensor, src: torch.Tensor) -> None:
        device = src.device
        stream = self.streams.get(device)
        if stream is None:
            stream = _side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the state training queued
            self.streams[device] = stream
        with torch.cuda.stream(stream):
            data.copy_(src, non_blocking=True)
        src.record_stream(stream)

    def finish(self) -> list[Any]:
        """Order training's later work after the copies; the events that mark them done."""
        events = []
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self.streams = {}
        return events


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """The snapshot's side stream on ``device`` (one per device and process, created once)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def wait_ready(flat: Flat) -> None:
    """Wait until the snapshot's device copies landed in its host buffers."""
    for event in flat.ready:
        event.synchronize()
