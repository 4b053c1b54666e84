"""The checkpoint's skeleton: nested containers and plain values as JSON, tensors as leaves.

The skeleton is JSON-serialisable and refers to tensors by index: the save side builds it while
it snapshots a state (:mod:`~lightning_incremental.core.save.snapshot`), ``unflatten`` rebuilds
the state. The skeleton can only
express data (the same contract as ``torch.load(weights_only=True)``), so loading never runs code;
values it cannot express are an error naming their key path, unless pickling was allowed.

Skeleton nodes: JSON ``null``/``true``/``false``/ints/strings stand for themselves; everything else
is a ``[tag, payload]`` list (tags below).

Sharded tensors (``DTensor``, ``ShardedTensor``) are one tensor of the skeleton each, snapshotted as
the pieces this process holds and writes (:mod:`~lightning_incremental.core.format.pieces`): one
leaf per piece, each naming the tensor's *slot* (its index in the skeleton). In a distributed save
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.errors import (
    CheckpointError,
    ManifestError,
    PickleNotAllowedError,
)

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
    data: torch.Tensor  # contiguous CPU tensor (its own buffer, or a view of a snapshot slab)
    dtype: str  # torch dtype name ("float32") or numpy dtype string ("<u4") when is_numpy
    shape: list[int]
    device: str
    width: int = 1  # byte-grouping width (see codec.group_width)
    is_numpy: bool = False
    parameter: bool = False
    requires_grad: bool = False
    slot: int = -1  # the tensor's index in the skeleton
    offsets: tuple[int, ...] | None = None  # a piece: where it starts in the global tensor
    # ``data``'s bytes as numpy sees them, when the snapshot had them at hand (a slab's slice)
    flat_bytes: np.ndarray | None = field(default=None, repr=False, compare=False)
    # the snapshot slab ``data`` is a view of (see .save.slabs), recycled as a whole
    slab: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        """What identifies this array across saves: its path, or a piece's key."""
        return self.path if self.offsets is None else piece_key(self.path, self.offsets)

    @property
    def nbytes(self) -> int:
        if self.flat_bytes is not None:
            return int(self.flat_bytes.size)
        return self.data.numel() * self.data.element_size()

    def raw(self) -> np.ndarray:
        """The leaf's bytes as a flat uint8 array (a view, no copy)."""
        if self.flat_bytes is not None:
            return self.flat_bytes
        data = self.data
        if data.numel() == 0:
            return np.empty(0, dtype=np.uint8)
        if data.dtype in _NUMPY_DTYPES:  # numpy's views cost a tenth of torch's per call
            return data.numpy().reshape(-1).view(np.uint8)
        return data.reshape(-1).view(torch.uint8).numpy()


CONTAINERS = (list, tuple, dict, OrderedDict, set, frozenset)
_NUMPY_DTYPES = frozenset(  # torch dtypes numpy holds as they are (not bfloat16, float8, ...)
    {
        torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    }
)  # fmt: skip


def key_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)  # a dict lookup: torch's getattr takes microseconds a tensor
    if dtype is None:
        dtype = getattr(torch, name, None) if name.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise ManifestError(f"unknown torch dtype {name!r} in manifest")
        _DTYPES[name] = dtype  # torch's dtypes only: a few dozen at most
    return dtype


_DTYPES: dict[str, torch.dtype] = {}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def float_hex(value: float) -> str:
    """Exact text of a float: ``float.hex`` when finite, the IEEE bits (``x`` + 16 hex digits)
    otherwise, so the sign and payload of a NaN survive."""
    return value.hex() if math.isfinite(value) else "x" + struct.pack(">d", value).hex()


def float_from_hex(text: str) -> float:
    if text.startswith("x"):
        return float(struct.unpack(">d", bytes.fromhex(text[1:]))[0])
    return float.fromhex(text)


class Flat:
    """A snapshotted state: its skeleton, the arrays this process writes, the key paths of
    pickled values, how many tensors the skeleton refers to (``slots``) and which of them are
    sharded. ``ready``: CUDA events, the leaves' device copies landed once they fired.

    ``finish`` builds leaves the snapshot left as placeholders (small tensors copied together,
    see :mod:`..save.slabs`); it runs on the first read of :attr:`leaves`, which is therefore
    best left to the save's background work."""

    def __init__(
        self,
        skeleton: Any,
        leaves: list[Leaf],
        pickled: list[str],
        slots: int,
        sharded: dict[int, ShardedInfo],
        ready: list[Any] | None = None,
        finish: Callable[[list[Leaf]], None] | None = None,
    ) -> None:
        self.skeleton, self.pickled, self.slots, self.sharded = skeleton, pickled, slots, sharded
        self.ready = ready if ready is not None else []
        self._leaves, self._finish = leaves, finish

    @property
    def leaves(self) -> list[Leaf]:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish(self._leaves)
        return self._leaves


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
            T_FLOAT: lambda p, _: float_from_hex(_str(p)),
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
            T_COMPLEX: lambda p, _: complex(*(float_from_hex(_str(x)) for x in _pair(p))),
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
