"""The checkpoint's skeleton: nested containers and plain values as JSON, tensors as leaves.

``flatten`` walks a state, snapshots every tensor to host memory and returns a JSON-serialisable
skeleton that refers to tensors by index. ``unflatten`` rebuilds the state. The skeleton can only
express data (the same contract as ``torch.load(weights_only=True)``), so loading never runs code;
values it cannot express are an error naming their key path, unless pickling was allowed.

Skeleton nodes: JSON ``null``/``true``/``false``/ints/strings stand for themselves; everything else
is a ``[tag, payload]`` list (tags below).

Sharded tensors (``DTensor``, ``ShardedTensor``) are one tensor of the skeleton each, snapshotted as
the pieces this process holds and writes (:mod:`~lightning_incremental.core.pieces`): one leaf per
piece, each naming the tensor's *slot* (its index in the skeleton). In a distributed save
(``rank`` given) every process walks the same state and numbers the same slots; plain tensors are
identical on every rank and snapshotted by rank 0 only.
"""

from __future__ import annotations

import base64
import math
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.codecs.bytes import group_width
from lightning_incremental.core.errors import (
    CheckpointError,
    ManifestError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from lightning_incremental.core.pieces import describe, global_shape, sharded_kind, spans_processes

# Tags of non-JSON nodes.
T_FLOAT, T_BYTES, T_LIST, T_TUPLE, T_DICT, T_ODICT = "f", "b", "l", "t", "d", "od"
T_SET, T_FROZENSET, T_COMPLEX, T_DTYPE, T_DEVICE, T_SIZE = (
    "set",
    "fset",
    "c",
    "dtype",
    "dev",
    "size",
)
T_TENSOR, T_NPSCALAR, T_PICKLE, T_BIGINT, T_ODICT_META = "T", "npv", "pkl", "i", "odm"

# Deepest nesting of containers a state may have. Each level is a few levels of JSON in the
# manifest, and JSON (like the walk itself) is recursive: this keeps far from Python's limit.
MAX_DEPTH = 100


def piece_key(path: str, offsets: tuple[int, ...] | list[int]) -> str:
    """The key of a piece of the tensor at ``path``: e.g. ``state['w']@0,512``. A key path always
    ends with ``]``, so no tensor's path is a piece's key."""
    return f"{path}@{','.join(map(str, offsets))}"


@dataclass(frozen=True)
class ShardedInfo:
    """The global description of a sharded tensor of the state."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    width: int
    parameter: bool
    requires_grad: bool


@dataclass
class Leaf:
    """One array of the state, snapshotted to contiguous host memory: a whole tensor, or (with
    ``offsets``) one piece of a sharded tensor, whose ``shape`` is then the piece's."""

    path: str  # key path of the leaf's first occurrence, e.g. "state['model']['w']"
    data: torch.Tensor  # contiguous CPU tensor owning its bytes (numpy arrays are wrapped)
    dtype: str  # torch dtype name ("float32") or numpy dtype string ("<u4") when is_numpy
    shape: list[int]
    device: str
    width: int = 1  # byte-grouping width (see codec.group_width)
    is_numpy: bool = False
    parameter: bool = False
    requires_grad: bool = False
    slot: int = -1  # the tensor's index in the skeleton
    offsets: tuple[int, ...] | None = None  # a piece: where it starts in the global tensor

    @property
    def key(self) -> str:
        """What identifies this array across saves: its path, or a piece's key."""
        return self.path if self.offsets is None else piece_key(self.path, self.offsets)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def raw(self) -> np.ndarray:
        """The leaf's bytes as a flat uint8 array (a view, no copy)."""
        if self.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        return self.data.reshape(-1).view(torch.uint8).numpy()


_CONTAINERS = (list, tuple, dict, OrderedDict, set, frozenset)


def key_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown torch dtype {name!r} in manifest")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _float_hex(value: float) -> str:
    """Exact text of a float: ``float.hex`` when finite, the IEEE bits (``x`` + 16 hex digits)
    otherwise, so the sign and payload of a NaN survive."""
    return value.hex() if math.isfinite(value) else "x" + struct.pack(">d", value).hex()


def _float_from_hex(text: str) -> float:
    if text.startswith("x"):
        return float(struct.unpack(">d", bytes.fromhex(text[1:]))[0])
    return float.fromhex(text)


@dataclass
class Flat:
    """A snapshotted state: its skeleton, the arrays this process writes, the key paths of
    pickled values, how many tensors the skeleton refers to (``slots``) and which of them are
    sharded."""

    skeleton: Any
    leaves: list[Leaf]
    pickled: list[str]
    slots: int
    sharded: dict[int, ShardedInfo]


class _Flattener:
    def __init__(self, allow_pickle: bool, pool: BufferPool | None, rank: int | None) -> None:
        self.allow_pickle = allow_pickle
        self.pool = pool
        self.rank = rank
        self.leaves: list[Leaf] = []
        self.slots = 0
        self.sharded: dict[int, ShardedInfo] = {}
        self.aliases: dict[tuple[Any, ...], int] = {}
        self.pickled: list[str] = []
        self.cuda = False

    def node(self, value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if len(path) >= MAX_DEPTH and kind in _CONTAINERS:
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
            return [T_FLOAT, _float_hex(value)]
        if kind is bytes:
            return [T_BYTES, base64.b64encode(value).decode("ascii")]
        if kind is list:
            return [T_LIST, [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if kind is tuple:
            return [T_TUPLE, [self.node(v, (*path, i)) for i, v in enumerate(value)]]
        if kind is dict or kind is OrderedDict:
            items = [[self.key(k, path), self.node(v, (*path, k))] for k, v in value.items()]
            metadata = getattr(value, "_metadata", None)
            if kind is OrderedDict and metadata is not None:
                # nn.Module.state_dict() keeps per-module versions here; torch.save keeps them
                return [T_ODICT_META, [items, self.node(metadata, (*path, "_metadata"))]]
            return [T_DICT if kind is dict else T_ODICT, items]
        if kind is set or kind is frozenset:
            tag = T_SET if kind is set else T_FROZENSET
            return [tag, [self.key(v, path) for v in value]]
        if kind is complex:
            return [T_COMPLEX, [_float_hex(value.real), _float_hex(value.imag)]]
        if kind is torch.dtype:
            return [T_DTYPE, dtype_name(value)]
        if kind is torch.device:
            return [T_DEVICE, str(value)]
        if kind is torch.Size:
            return [T_SIZE, list(value)]
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return [T_TENSOR, self.tensor(value, path)]
        if isinstance(value, torch.Tensor) and sharded_kind(value) is not None:
            return [T_TENSOR, self.sharded_tensor(value, path)]
        if kind is np.ndarray and value.dtype.kind in "biufc" and not value.dtype.hasobject:
            return [T_TENSOR, self.ndarray(value, path)]
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            payload = base64.b64encode(value.tobytes()).decode("ascii")
            return [T_NPSCALAR, [value.dtype.str, payload]]
        return self.pickle(value, path)

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

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        where = key_path(path)
        if t.layout != torch.strided:
            raise UnsupportedValueError(
                f"{where} is a {t.layout} tensor; only dense (strided) tensors are supported — "
                "save t.to_dense() instead"
            )
        if t.is_quantized or t.is_nested:
            raise UnsupportedValueError(f"{where} is a quantized or nested tensor; not supported")
        if t.device.type == "meta":
            raise UnsupportedValueError(f"{where} is a meta tensor and holds no data to save")
        alias = (  # the same view of the same storage, seen the same way: one leaf
            t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else None,
            t.device,
            t.dtype,
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            type(t),
            t.requires_grad,
            t.is_conj(),
            t.is_neg(),
        )
        if alias[0] is not None and alias in self.aliases:
            return self.aliases[alias]
        slot = self._slot(alias)
        if self.rank not in (None, 0):
            return slot  # identical on every rank: rank 0 writes it
        self.leaves.append(self.snapshot(t, where, slot))
        return slot

    def _slot(self, alias: tuple[Any, ...] | None) -> int:
        slot = self.slots
        self.slots += 1
        if alias is not None and alias[0] is not None:
            self.aliases[alias] = slot
        return slot

    def _copy(self, src: torch.Tensor) -> torch.Tensor:
        on_cuda = src.device.type == "cuda"
        pin = on_cuda and torch.cuda.is_available()
        if self.pool is not None:
            data = self.pool.take(src.shape, src.dtype, pin=pin)
        else:
            data = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        data.copy_(src, non_blocking=on_cuda)
        self.cuda = self.cuda or on_cuda
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
            parameter=isinstance(t, torch.nn.Parameter),
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
        slot = self._slot(None)
        local = pieces[0].tensor if pieces else None
        self.sharded[slot] = ShardedInfo(
            path=where,
            dtype=dtype_name(t.dtype),
            shape=global_shape(t),
            device=str(local.device if local is not None else t.device),
            width=group_width(t.dtype.itemsize, t.dtype.is_complex),
            parameter=isinstance(t, torch.nn.Parameter),
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
        slot = self._slot(None)
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
    skeleton = flattener.node(state, ())
    if flattener.cuda:
        torch.cuda.synchronize()
    return Flat(skeleton, flattener.leaves, flattener.pickled, flattener.slots, flattener.sharded)


def unflatten(skeleton: Any, tensors: list[Any], *, allow_pickle: bool = False) -> Any:
    """Rebuild the state from its skeleton and its restored arrays (indexed like the leaves).

    Raises:
        ManifestError: a malformed skeleton.
        PickleNotAllowedError: a pickled value and ``allow_pickle`` is False.
    """
    try:
        return _Unflattener(tensors, allow_pickle).node(skeleton, ())
    except RecursionError as exc:
        raise ManifestError("the state's skeleton is nested too deeply") from exc


class _Unflattener:
    def __init__(self, tensors: list[Any], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.handlers: dict[str, Callable[[Any, tuple[Any, ...]], Any]] = {
            T_FLOAT: lambda p, _: _float_from_hex(_str(p)),
            T_BIGINT: lambda p, _: int(_str(p), 16),
            T_BYTES: lambda p, _: base64.b64decode(_str(p), validate=True),
            T_LIST: lambda p, path: [self.node(v, (*path, i)) for i, v in enumerate(_list(p))],
            T_TUPLE: lambda p, path: tuple(
                self.node(v, (*path, i)) for i, v in enumerate(_list(p))
            ),
            T_DICT: lambda p, path: dict(self.items(p, path)),
            T_ODICT: lambda p, path: OrderedDict(self.items(p, path)),
            T_ODICT_META: self.odict_with_metadata,
            T_SET: lambda p, path: {self.node(v, path) for v in _list(p)},
            T_FROZENSET: lambda p, path: frozenset(self.node(v, path) for v in _list(p)),
            T_COMPLEX: lambda p, _: complex(*(_float_from_hex(_str(x)) for x in _pair(p))),
            T_DTYPE: lambda p, _: torch_dtype(_str(p)),
            T_DEVICE: lambda p, _: torch.device(_str(p)),
            T_SIZE: lambda p, _: torch.Size([_int(x) for x in _list(p)]),
            T_TENSOR: self.tensor,
            T_NPSCALAR: self.np_scalar,
            T_PICKLE: self.unpickle,
        }

    def node(self, node: Any, path: tuple[Any, ...]) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
            raise ManifestError(f"malformed skeleton node at {key_path(path)}: {node!r:.80}")
        handler = self.handlers.get(node[0])
        if handler is None:
            raise ManifestError(f"unknown skeleton tag {node[0]!r} at {key_path(path)}")
        try:
            return handler(node[1], path)
        except (CheckpointError, RecursionError):
            raise
        except Exception as exc:  # hostile payloads: any parse failure is a bad manifest
            raise ManifestError(f"malformed skeleton node at {key_path(path)}: {exc}") from exc

    def items(self, payload: Any, path: tuple[Any, ...]) -> list[tuple[Any, Any]]:
        out = []
        for pair in _list(payload):
            key_node, value_node = _pair(pair)
            key = self.node(key_node, path)
            out.append((key, self.node(value_node, (*path, key))))
        return out

    def odict_with_metadata(self, payload: Any, path: tuple[Any, ...]) -> Any:
        items, metadata = _pair(payload)
        value = OrderedDict(self.items(items, path))
        value._metadata = self.node(metadata, (*path, "_metadata"))  # type: ignore[attr-defined]
        return value

    def tensor(self, payload: Any, path: tuple[Any, ...]) -> Any:
        index = _int(payload)
        if not 0 <= index < len(self.tensors):
            raise ManifestError(f"tensor index {index} out of range at {key_path(path)}")
        return self.tensors[index]

    def np_scalar(self, payload: Any, path: tuple[Any, ...]) -> Any:
        dtype_str, data = _pair(payload)
        dtype = np.dtype(_str(dtype_str))
        if dtype.kind not in "biufc":
            raise ManifestError(f"numpy scalar of dtype {dtype} at {key_path(path)}")
        raw = base64.b64decode(_str(data), validate=True)
        return np.frombuffer(raw, dtype=dtype)[0]

    def unpickle(self, payload: Any, path: tuple[Any, ...]) -> Any:
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"{key_path(path)} is a pickled object and loading it would execute code; "
                "open the store with allow_pickle=True only if you trust this checkpoint"
            )
        return pickle.loads(base64.b64decode(_str(payload), validate=True))  # noqa: S301


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"expected an int, got {type(value).__name__}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"expected a list, got {type(value).__name__}")
    return value


def _pair(value: Any) -> list[Any]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ManifestError(f"expected a pair, got {value!r:.80}")
    return value
