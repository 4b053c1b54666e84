"""Properties of the skeleton (lightning_incremental.core.format.tree): flatten / unflatten.

Every value the skeleton can express comes back with the same type and the same bits, through
a JSON round trip of the skeleton; every value it cannot express is refused naming its key path;
every malformed skeleton is a ManifestError.
"""

from __future__ import annotations

import collections
import enum
import json
import math
import re
import struct
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lightning_incremental.core.codecs import group_width
from lightning_incremental.core.errors import (
    ManifestError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from lightning_incremental.core.format.tree import Leaf, unflatten
from lightning_incremental.core.save.snapshot import flatten
from tests.conftest import assert_state_equal

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

props = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- helpers


def materialise(leaf: Leaf) -> Any:
    """What the store hands ``unflatten`` for a leaf: the array rebuilt from the leaf's data."""
    if leaf.is_numpy:
        return leaf.data.numpy().view(np.dtype(leaf.dtype)).reshape(leaf.shape)
    tensor = leaf.data.reshape(leaf.shape)
    if leaf.parameter:
        return torch.nn.Parameter(tensor, requires_grad=leaf.requires_grad)
    if leaf.requires_grad:
        tensor.requires_grad_(True)
    return tensor


def roundtrip(state: Any, *, allow_pickle: bool = False) -> Any:
    """flatten -> JSON text -> unflatten, checking the skeleton is plain JSON on the way."""
    skeleton, leaves, _ = flatten(state, allow_pickle=allow_pickle)
    text = json.dumps(skeleton, allow_nan=False)
    loaded = json.loads(text)
    # plain JSON only: no tuples, no floats, nothing json would silently change
    assert loaded == skeleton
    assert json.dumps(loaded, allow_nan=False) == text
    return unflatten(loaded, [materialise(leaf) for leaf in leaves], allow_pickle=allow_pickle)


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with default strides, same type and requires_grad (conftest's
    assert_state_equal cannot view a size-1 dimension with a non-unit stride as bytes)."""
    copy = torch.empty(t.shape, dtype=t.dtype)
    copy.copy_(t.detach().resolve_conj().resolve_neg())
    if type(t) is torch.nn.Parameter:
        return torch.nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(True) if t.requires_grad else copy


def assert_same(actual: Any, expected: Any, path: str = "state") -> None:
    """Same type and same bits, recursively (NaN: any NaN; see test_nan_bits_survive)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert_state_equal(actual, fresh(expected), path)
    elif isinstance(expected, np.ndarray):
        assert actual.dtype.str == expected.dtype.str, f"{path}: {actual.dtype} {expected.dtype}"
        assert actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: bytes differ"
    elif isinstance(expected, np.generic):
        assert actual.dtype.str == expected.dtype.str, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: bytes differ"
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), f"{path}: expected nan, got {actual!r}"
        else:
            assert bits(actual) == bits(expected), f"{path}: {actual!r} != {expected!r}"
    elif isinstance(expected, complex):
        assert_same(actual.real, expected.real, f"{path}.real")
        assert_same(actual.imag, expected.imag, f"{path}.imag")
    elif isinstance(expected, dict):
        assert len(actual) == len(expected), f"{path}: {len(actual)} keys != {len(expected)}"
        for (ka, va), (ke, ve) in zip(actual.items(), expected.items()):
            assert_same(ka, ke, f"{path} key {ke!r}")
            assert_same(va, ve, f"{path}[{ke!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaNs, infinities, subnormals included)."""
    numel = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(np.bool_))
    raw = bytearray(rng.bytes(numel * size))
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def dtype_list(*names: str) -> list[torch.dtype]:
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


ALL_DTYPES = dtype_list(
    "float32",
    "float16",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex32",
    "complex64",
    "complex128",
)
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 5), (1, 1, 1, 1), (33, 17), (256, 1024)]


# ---------------------------------------------------------------- plain values

hashables = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(max_size=6),
        st.binary(max_size=6),
    ),
    lambda c: st.one_of(st.tuples(c, c), st.frozensets(c, max_size=3)),
    max_leaves=4,
)
plain_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**400), 2**400),
    st.floats(),
    st.text(alphabet=st.characters(exclude_categories=())),  # lone surrogates included
    st.binary(max_size=64),
    st.complex_numbers(),
    st.sampled_from(ALL_DTYPES),
    st.sampled_from(
        [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"), torch.device("cuda")]
    ),
    st.lists(st.integers(0, 1 << 40), max_size=5).map(torch.Size),
    st.sets(hashables, max_size=5),
    st.frozensets(hashables, max_size=5),
)
plain_values = st.recursive(
    plain_scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(hashables, c, max_size=4),
        st.dictionaries(hashables, c, max_size=4).map(OrderedDict),
    ),
    max_leaves=25,
)


@props
@given(value=plain_values)
def test_plain_values_round_trip(value: Any) -> None:
    state = {"v": value}
    _, leaves, pickled = flatten(state)
    assert leaves == [] and pickled == []
    assert_same(roundtrip(state), state)


@props
@given(value=plain_values)
def test_plain_values_round_trip_at_the_top_level(value: Any) -> None:
    assert_same(roundtrip(value), value)


@pytest.mark.parametrize(
    "value",
    [
        0.0,
        -0.0,
        1.0,
        -1.5,
        math.inf,
        -math.inf,
        5e-324,
        -5e-324,
        2.2250738585072014e-308,
        1.7976931348623157e308,
        0.1,
        1 / 3,
        math.pi,
        float("nan"),
    ],
    ids=repr,
)
def test_float_bits_round_trip(value: float) -> None:
    other = value if math.isnan(value) else -value  # NaN signs: see test_nan_bits_survive
    out = roundtrip({"f": value, "c": complex(value, other), "l": [value]})
    assert bits(out["f"]) == bits(value)
    assert bits(out["l"][0]) == bits(value)
    assert bits(out["c"].real) == bits(value)
    assert bits(out["c"].imag) == bits(other)


@pytest.mark.parametrize(
    "pattern",
    [
        "7ff8000000000000",
        "fff8000000000000",
        "7ff8000000000001",
        "7ff0000000000001",
        "fff4000000000abc",
    ],
)
def test_nan_bits_survive(pattern: str) -> None:
    """A NaN is restored with its own sign and payload, like every other float."""
    value = struct.unpack(">d", bytes.fromhex(pattern))[0]
    out = roundtrip({"f": value, "c": complex(1.0, value)})
    assert struct.pack(">d", out["f"]).hex() == pattern
    assert struct.pack(">d", out["c"].imag).hex() == pattern


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**64), 10**100, -(10**1000), 10**4000],
    ids=lambda v: f"int{len(str(v))}",
)
def test_ints_round_trip_exactly(value: int) -> None:
    out = roundtrip({"i": value, "k": {value: value}})
    assert type(out["i"]) is int and out["i"] == value
    assert list(out["k"].items()) == [(value, value)]


@pytest.mark.parametrize("digits", [4300, 5000, 20000])
def test_ints_past_the_json_digit_limit_are_refused_or_survive(digits: int) -> None:
    """Whatever flatten accepts must survive the JSON skeleton (the manifest is JSON); a value
    that cannot is refused up front naming its key path, not failing later in the save."""
    value = 10**digits - 1
    state = {"big": [value]}
    try:
        skeleton, _, _ = flatten(state)
    except UnsupportedValueError as exc:
        assert "state['big'][0]" in str(exc)
        return
    assert unflatten(json.loads(json.dumps(skeleton)), []) == state


def test_strings_round_trip_including_unicode_and_surrogates() -> None:
    values = [
        "",
        "ascii",
        "ümlaut",
        "日本語",
        "emoji 🎉",
        "\x00nul",
        "\ud800lone",
        "a\u2028b",
        '"quoted"',
        "back\\slash",
        "['a']",
    ]
    state = {v: v for v in values}
    assert_same(roundtrip(state), state)


def test_containers_keep_their_types_and_order() -> None:
    state = {
        "list": [1, [2, (3,)]],
        "tuple": (1, (2, [3]), ()),
        "empty": ([], (), {}, OrderedDict(), set(), frozenset()),
        "od": OrderedDict([("z", 1), ("a", 2), ("m", OrderedDict([(3, "x"), (1, "y")]))]),
        "dict": {"z": 1, "a": 2},
        "keys": {
            1: "int",
            "1": "str",
            (1, "a"): "tuple",
            None: "none",
            1.5: "float",
            b"b": "bytes",
            frozenset({1, 2}): "fset",
            -0.5: "neg",
            False: "bool",
        },
        "set": {1, "a", (2, 3), None, frozenset({4})},
        "fset": frozenset({1, 2, ("x", b"y")}),
    }
    out = roundtrip(state)
    assert_same(out, state)
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["z", "a", "m"]
    assert type(out["od"]["m"]) is OrderedDict
    assert list(out["dict"]) == ["z", "a"]
    assert type(out["empty"][3]) is OrderedDict and type(out["empty"][5]) is frozenset


def test_torch_and_numpy_plain_values() -> None:
    state = {
        "dtypes": ALL_DTYPES,
        "devices": [
            torch.device("cpu"),
            torch.device("cuda:3"),
            torch.device("meta"),
            torch.device("mps"),
        ],
        "sizes": [torch.Size([]), torch.Size([0]), torch.Size([2, 3, 4])],
        "np": [
            np.float32(1.5),
            np.float64("nan"),
            np.float16(0.1),
            np.int8(-3),
            np.int64(-(2**63)),
            np.uint64(2**64 - 1),
            np.bool_(True),
            np.bool_(False),
            np.complex64(1 + 2j),
            np.complex128(complex(math.inf, -0.0)),
            np.longdouble("1.1"),
            np.uint8(255),
            np.int16(-1),
            np.uint32(7),
        ],
    }
    out = roundtrip(state)
    assert_same(out, state)
    for a, e in zip(out["np"], state["np"]):
        assert type(a) is type(e)


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensors_of_every_dtype_and_shape_round_trip(dtype: torch.dtype, shape: tuple) -> None:
    t = random_tensor(dtype, shape, seed=len(shape))
    state = {"t": t, "nested": [{"t2": random_tensor(dtype, shape, seed=99)}]}
    _, leaves, _ = flatten(state)
    assert len(leaves) == 2
    leaf = leaves[0]
    assert leaf.path == "state['t']"
    assert leaves[1].path == "state['nested'][0]['t2']"
    assert leaf.dtype == str(dtype).removeprefix("torch.")
    assert leaf.shape == list(shape)
    assert leaf.device == "cpu"
    assert leaf.data.is_contiguous() and leaf.data.dtype == dtype
    assert leaf.width == group_width(t.element_size(), t.is_complex())
    assert leaf.nbytes == t.numel() * t.element_size()
    assert leaf.raw().tobytes() == (
        t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    )
    out = roundtrip(state)
    assert_same(out, state)


def test_the_snapshot_is_a_copy() -> None:
    t = torch.arange(10, dtype=torch.float32)
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    state = {"t": t, "a": a}
    expected_t, expected_a = t.clone(), a.copy()
    skeleton, leaves, _ = flatten(state)
    t.add_(100)
    a += 100
    out = unflatten(skeleton, [materialise(leaf) for leaf in leaves])
    assert_state_equal(out, {"t": expected_t, "a": expected_a})


def _views() -> dict[str, torch.Tensor]:
    base = random_tensor(torch.float32, (6, 8), seed=5)
    cbase = random_tensor(torch.complex64, (4, 5), seed=6)
    return {
        "transpose": base.T,
        "stride2": base[:, ::2],
        "offset": base[2:, 3:],
        "narrow": base.narrow(1, 2, 3),
        "expand": base[0].expand(3, 8),
        "broadcast0": torch.tensor(7.0).expand(5, 5),
        "permute": random_tensor(torch.int16, (2, 3, 4), seed=7).permute(2, 0, 1),
        "unfold": base.reshape(-1).unfold(0, 4, 3),
        "diagonal": base.diagonal(),
        "bf16_col": random_tensor(torch.bfloat16, (5, 5), seed=8)[:, 1],
        "bool_t": random_tensor(torch.bool, (3, 7), seed=9).T,
        "complex_slice": cbase[1:, ::2],
        "conj": cbase.conj(),
        "conj128": random_tensor(torch.complex128, (3, 3), seed=10).conj(),
        "neg_view": cbase.conj().imag,  # a negative view
        "real": cbase.real,
        "u8_view": base.view(torch.uint8)[::3],
    }


@pytest.mark.parametrize("name", list(_views()))
def test_non_contiguous_conj_and_neg_views_round_trip(name: str) -> None:
    view = _views()[name]
    _, leaves, _ = flatten({"v": view})
    assert leaves[0].data.is_contiguous()
    assert not leaves[0].data.is_conj() and not leaves[0].data.is_neg()
    out = roundtrip({"v": view})
    assert out["v"].is_contiguous()
    assert_same(out, {"v": view})


def test_views_of_one_storage_round_trip_separately() -> None:
    base = random_tensor(torch.float32, (4, 6), seed=11)
    state = {
        "base": base,
        "row": base[1],
        "col": base[:, 2],
        "flat": base.view(-1),
        "ints": base.view(torch.int32),
    }
    _, leaves, _ = flatten(state)
    assert len(leaves) == 5
    out = roundtrip(state)
    assert_same(out, state)


def test_the_same_view_twice_is_one_leaf_restored_as_one_object() -> None:
    t = random_tensor(torch.float32, (5, 3), seed=12)
    row = t[2]
    state = {"a": t, "b": [t, {"c": t}], "r1": row, "r2": t[2], "tuple": (t, row)}
    _, leaves, _ = flatten(state)
    assert len(leaves) == 2  # t, and the row view (two different objects, same view)
    out = roundtrip(state)
    assert_same(out, state)
    assert out["a"] is out["b"][0] is out["b"][1]["c"] is out["tuple"][0]
    assert out["r1"] is out["r2"] is out["tuple"][1]


def test_empty_tensors_are_never_aliased() -> None:
    a, b = torch.empty(0), torch.empty(0, dtype=torch.int64)
    out = roundtrip({"a": a, "b": b, "a2": a})
    assert_same(out, {"a": a, "b": b, "a2": a})


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: {"x": x, "xc": x.conj()}, id="tensor-and-its-conj-view"),
        pytest.param(lambda x: {"xc": x.conj(), "x": x}, id="conj-view-then-tensor"),
        pytest.param(lambda x: {"im": x.imag, "neg": x.conj().imag}, id="imag-and-neg-view"),
    ],
)
def test_conj_and_neg_views_of_a_saved_tensor_keep_their_values(make: Any) -> None:
    """A tensor and a conj (or neg) view of it share storage, offset, shape, stride and dtype,
    but not their values: they must not be merged into one leaf."""
    x = random_tensor(torch.complex64, (3, 4), seed=13)
    state = make(x)
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    out = roundtrip(state)
    assert_same(out, expected)


def test_aliases_keep_their_own_type_and_requires_grad() -> None:
    """``t`` and ``nn.Parameter(t)`` (or ``p`` and ``p.detach()``) share one view of one storage
    but are different objects: each comes back with its own type and requires_grad."""
    t = random_tensor(torch.float32, (4,), seed=14)
    p = torch.nn.Parameter(t)
    state = {"t": t, "p": p, "p_detached": p.detach()}
    out = roundtrip(state)
    assert_same(out, state)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameters_round_trip(requires_grad: bool) -> None:
    w = torch.nn.Parameter(
        random_tensor(torch.float32, (3, 4), seed=15), requires_grad=requires_grad
    )
    ints = torch.nn.Parameter(torch.arange(5), requires_grad=False)
    plain = torch.randn(3, requires_grad=True)
    computed = plain * 2  # a non-leaf tensor requiring grad
    state = {"w": w, "ints": ints, "plain": plain, "computed": computed}
    _, leaves, _ = flatten(state)
    assert [leaf.parameter for leaf in leaves] == [True, True, False, False]
    assert [leaf.requires_grad for leaf in leaves] == [requires_grad, False, True, True]
    out = roundtrip(state)
    assert type(out["w"]) is torch.nn.Parameter and out["w"].requires_grad is requires_grad
    assert type(out["ints"]) is torch.nn.Parameter and not out["ints"].requires_grad
    assert type(out["plain"]) is torch.Tensor and out["plain"].requires_grad
    assert torch.equal(out["computed"].detach(), computed.detach())
    assert_same(out, state)


tensor_dtypes = st.sampled_from(ALL_DTYPES)
shapes = st.lists(st.integers(0, 6), max_size=4).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    t = random_tensor(draw(tensor_dtypes), draw(shapes), seed=draw(st.integers(0, 2**32 - 1)))
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]
    if t.is_complex() and draw(st.booleans()):
        t = t.conj()
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    state=st.dictionaries(
        st.text(max_size=4),
        st.recursive(
            st.one_of(tensors(), plain_scalars),
            lambda c: st.one_of(
                st.lists(c, max_size=3),
                st.lists(c, max_size=3).map(tuple),
                st.dictionaries(hashables, c, max_size=3),
            ),
            max_leaves=12,
        ),
    )
)
def test_random_states_with_tensors_round_trip(state: dict) -> None:
    out = roundtrip(state)
    assert_same(out, state)


# ---------------------------------------------------------------- numpy arrays

NUMPY_DTYPES = [
    "?",
    "i1",
    "i2",
    "i4",
    "i8",
    "u1",
    "u2",
    "u4",
    "u8",
    "f2",
    "f4",
    "f8",
    "g",
    "c8",
    "c16",
    ">i2",
    ">i4",
    ">i8",
    ">u4",
    ">f4",
    ">f8",
    ">c16",
    "<f8",
    "<i4",
]


@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (1,), (5,), (3, 4), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_round_trip(dtype: str, shape: tuple) -> None:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(len(shape))
    n = math.prod(shape)
    if dt.kind == "b":
        a = rng.integers(0, 2, size=shape).astype(dt)
    else:
        a = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=dt).reshape(shape).copy()
    state = {"a": a}
    _, leaves, _ = flatten(state)
    assert leaves[0].is_numpy and leaves[0].dtype == dt.str and leaves[0].shape == list(shape)
    assert leaves[0].data.dtype == torch.uint8 and leaves[0].data.dim() == 1
    out = roundtrip(state)
    assert type(out["a"]) is np.ndarray
    assert_same(out, state)


def test_non_contiguous_numpy_arrays_round_trip() -> None:
    a = np.arange(60, dtype=">f8").reshape(3, 4, 5)
    state = {
        "T": a.T,
        "step": a[:, ::2, 1:],
        "fortran": np.asfortranarray(a),
        "neg": a[::-1, :, ::-2],
        "bcast": np.broadcast_to(np.arange(3), (4, 3)),
    }
    out = roundtrip(state)
    assert_same(out, state)
    for value in out.values():
        assert value.flags.c_contiguous


# ---------------------------------------------------------------- unsupported values


class Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and other.x == self.x

    __hash__ = None  # type: ignore[assignment]


class MyDict(dict):
    pass


class MyStr(str):
    pass


Pair = namedtuple("Pair", "a b")


def _sparse() -> torch.Tensor:
    return torch.eye(3).to_sparse()


UNSUPPORTED = {
    "lambda": lambda: lambda x: x,
    "custom-instance": lambda: Point(1),
    "namedtuple": lambda: Pair(1, 2),
    "dict-subclass": lambda: MyDict(a=1),
    "defaultdict": lambda: defaultdict(list),
    "counter": lambda: collections.Counter("aab"),
    "sparse-tensor": _sparse,
    "sparse-csr": lambda: torch.eye(3).to_sparse_csr(),
    "meta-tensor": lambda: torch.empty(3, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "object-array": lambda: np.array([None, 1], dtype=object),
    "str-array": lambda: np.array(["a", "b"]),
    "datetime-array": lambda: np.array(["2020-01-01"], dtype="datetime64[D]"),
    "module": lambda: torch.nn.Linear(1, 1),
    "type": lambda: int,
    "generator": lambda: (i for i in range(3)),
    "int-enum": lambda: enum.IntEnum("E", "A").A,
    "str-subclass": lambda: MyStr("x"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_values_name_their_key_path(name: str) -> None:
    value = UNSUPPORTED[name]()
    with pytest.raises(UnsupportedValueError, match=re.escape("state['a'][0]")):
        flatten({"a": [value]})
    with pytest.raises(UnsupportedValueError, match=re.escape("state['x'][1]['y'][2]")):
        flatten({"x": (0, {"y": [1, 2, value]})})
    # straight in a dict (a tensor there is noted with its dict's path and its key)
    with pytest.raises(UnsupportedValueError, match=re.escape("state['a']['b']")):
        flatten({"a": {"b": value}})
    with pytest.raises(TypeError):  # UnsupportedValueError is a TypeError
        flatten({"a": value})


def test_a_tensor_as_dict_key_or_set_member_is_refused() -> None:
    t = torch.zeros(1)
    with pytest.raises(UnsupportedValueError, match=re.escape("state['d']")):
        flatten({"d": {t: 1}})
    with pytest.raises(UnsupportedValueError, match=re.escape("state['s']")):
        flatten({"s": {t}})


PICKLABLE = {
    "custom-instance": lambda: Point(3),
    "namedtuple": lambda: Pair(1, [2, 3]),
    "dict-subclass": lambda: MyDict(a=1, b=[2]),
    "defaultdict": lambda: defaultdict(list, {"k": [1]}),
    "counter": lambda: collections.Counter("aab"),
    "object-array": lambda: np.array([None, 1], dtype=object),
    "datetime-array": lambda: np.array(["2020-01-01"], dtype="datetime64[D]"),
}


@pytest.mark.parametrize("name", list(PICKLABLE))
def test_allow_pickle_round_trips_and_is_needed_to_load(name: str) -> None:
    value = PICKLABLE[name]()
    state = {"a": [value], "b": {"c": value}, "plain": 1}
    skeleton, leaves, pickled = flatten(state, allow_pickle=True)
    assert pickled == ["state['a'][0]", "state['b']['c']"]
    loaded = json.loads(json.dumps(skeleton, allow_nan=False))
    tensors = [materialise(leaf) for leaf in leaves]
    out = unflatten(loaded, tensors, allow_pickle=True)
    for restored in (out["a"][0], out["b"]["c"]):
        assert type(restored) is type(value)
        if isinstance(value, np.ndarray):
            assert restored.dtype == value.dtype and restored.tolist() == value.tolist()
        else:
            assert restored == value
    assert out["plain"] == 1
    with pytest.raises(PickleNotAllowedError, match=re.escape("state['a'][0]")):
        unflatten(loaded, tensors)


def test_allow_pickle_does_not_pickle_what_cannot_be_pickled_or_saved() -> None:
    with pytest.raises(UnsupportedValueError, match=re.escape("state['f'][0]")):
        flatten({"f": [lambda: 1]}, allow_pickle=True)
    with pytest.raises(UnsupportedValueError, match=re.escape("state['s']")):
        flatten({"s": _sparse()}, allow_pickle=True)
    with pytest.raises(UnsupportedValueError, match=re.escape("state['m']")):
        flatten({"m": torch.empty(2, device="meta")}, allow_pickle=True)


# ---------------------------------------------------------------- malformed skeletons

MALFORMED = [
    ["zz", 1],  # unknown tag
    ["", 1],
    ["l"],  # wrong arity
    ["l", [], 3],
    [],
    [1, 2],  # tag not a string
    [None, []],
    1.5,  # a bare JSON float is not a node
    {"a": 1},  # a bare JSON object is not a node
    ["T", 0],  # tensor index out of range (no tensors)
    ["T", -1],
    ["T", "0"],
    ["T", True],
    ["T", 0.0],
    ["f", "not-a-float"],
    ["f", 1.5],
    ["b", "!!!"],
    ["b", 3],
    ["c", ["0x1p+0"]],
    ["c", "0x1p+0"],
    ["dtype", "float99"],
    ["dtype", "Tensor"],
    ["dtype", "__class__"],
    ["size", ["a"]],
    ["size", 3],
    ["l", {"a": 1}],
    ["d", [["a"]]],
    ["d", [["a", 1, 2]]],
    ["d", "ab"],
    ["od", [[["l", []], 1]]],  # unhashable key
    ["set", [["l", []]]],  # unhashable member
    ["fset", [["d", []]]],
    ["npv", ["<U4", "AAAA"]],
    ["npv", ["O", "AAAA"]],
    ["npv", ["garbage", "AAAA"]],
    ["npv", ["<f8", "AAA="]],  # 2 bytes for an 8-byte scalar
    ["npv", ["<f8"]],
    ["pkl", 5],
    ["d", [["a", ["l", [1, ["zz", 0]]]]]],  # nested
]


@pytest.mark.parametrize("node", MALFORMED, ids=lambda n: json.dumps(n)[:40])
def test_malformed_skeletons_raise_manifest_error(node: Any) -> None:
    with pytest.raises(ManifestError):
        unflatten(node, [], allow_pickle=True)


@pytest.mark.parametrize(
    "node",
    [
        ["dev", "nonsense"],
        ["dev", "cuda:-5"],
        ["dev", 3],
        ["npv", ["<f8", ""]],
        ["dev", ""],
        ["size", [True]],
        ["size", [1.5]],
    ],
    ids=json.dumps,
)
def test_malformed_payloads_raise_manifest_error(node: Any) -> None:
    """Payloads a hostile or corrupted manifest can carry: the contract is ManifestError, never
    another exception escaping from torch or numpy."""
    with pytest.raises(ManifestError):
        unflatten(node, [])


def test_malformed_nodes_name_their_key_path() -> None:
    node = ["d", [["model", ["l", [1, ["zz", 0]]]]]]
    with pytest.raises(ManifestError, match=re.escape("state['model'][1]")):
        unflatten(node, [])
    with pytest.raises(ManifestError, match=re.escape("state['w']")):
        unflatten(["d", [["w", ["T", 3]]]], [torch.zeros(1)])


def test_tensor_indices_in_range_are_accepted() -> None:
    tensors = [torch.zeros(1), torch.ones(2)]
    out = unflatten(["d", [["a", ["T", 1]], ["b", ["T", 0]], ["c", ["T", 1]]]], tensors)
    assert out["a"] is tensors[1] and out["b"] is tensors[0] and out["c"] is tensors[1]
    with pytest.raises(ManifestError, match="out of range"):
        unflatten(["T", 2], tensors)


TAGS = [
    "f",
    "b",
    "l",
    "t",
    "d",
    "od",
    "set",
    "fset",
    "c",
    "dtype",
    "dev",
    "size",
    "T",
    "npv",
    "pkl",
    "zz",
]
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(
        ["0x1p+0", "nan", "-inf", "AAAA", "AAA=", "cpu", "<f8", "float32", "cuda:0", ""]
    ),
)
json_nodes = st.recursive(
    st.one_of(json_scalars, st.tuples(st.sampled_from(TAGS), json_scalars).map(list)),
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.tuples(st.sampled_from(TAGS), c).map(list),
        st.dictionaries(st.text(max_size=3), c, max_size=2),
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node=json_nodes)
@example(node=["dev", ""])
@example(node=["l", [["npv", ["<f8", ""]]]])
def test_fuzz_unflatten_raises_only_manifest_errors(node: Any) -> None:
    try:
        unflatten(node, [torch.zeros(1)])
    except (ManifestError, PickleNotAllowedError):
        pass


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64,
     torch.uint8, torch.float8_e4m3fn],
)  # fmt: skip
def test_a_leafs_raw_bytes_are_a_view_of_its_data_in_every_dtype(dtype: torch.dtype) -> None:
    from lightning_incremental.core.format.tree import Leaf

    data = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    leaf = Leaf(path="state['w']", data=data, dtype=str(dtype), shape=[2, 3, 4], device="cpu")
    raw = leaf.raw()
    assert raw.dtype == np.uint8 and raw.shape == (data.numel() * data.element_size(),)
    assert raw.tobytes() == data.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert np.shares_memory(raw, data.view(torch.uint8).numpy()), "a view, not a copy"
    empty = Leaf(path="e", data=torch.empty(0, 3, dtype=dtype), dtype="x", shape=[0, 3], device="c")
    assert empty.raw().shape == (0,)


def test_the_parameter_flag_is_what_isinstance_says() -> None:
    from lightning_incremental.core.save.snapshot import flatten

    marked = torch.zeros(2)
    marked._is_param = True  # type: ignore[attr-defined]  # Parameter's instance check reads it
    values = [torch.zeros(2), torch.nn.Parameter(torch.ones(2)), marked]
    _, leaves, _ = flatten({str(i): v for i, v in enumerate(values)})
    assert (
        [leaf.parameter for leaf in leaves]
        == [isinstance(v, torch.nn.Parameter) for v in values]
        == [False, True, True]
    )
