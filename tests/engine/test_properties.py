"""Engine properties through the public CheckpointStore API.

Random nested states round-trip bit-identically; random sequences of modifications (sparse
updates, dense small noise, frozen parts, dtype and shape changes, keys added and removed) with
small chunks, short chains and frequent full bases restore EVERY committed step exactly — also
after compact, after gc of the others, from a reopened store, and after continuing to save from a
reopened store. Byte counts of unchanged and sparse saves are bounded, deterministically.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    SaveResult,
    Storage,
)
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import open_storage
from tests.conftest import assert_state_equal

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DTYPES = [
    getattr(torch, n)
    for n in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
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
    if isinstance(getattr(torch, n, None), torch.dtype)
]
NUMPY_OK = {
    torch.float32,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def location(backend: str) -> Iterator[str]:
    """A fresh, empty store location, removed afterwards (usable inside a hypothesis example)."""
    if backend == "local":
        root = tempfile.mkdtemp(prefix="li-prop-")
        try:
            yield f"{root}/store"
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        url = f"memory://li-prop-{uuid.uuid4().hex}"
        try:
            yield url
        finally:
            import fsspec

            fs = fsspec.filesystem("memory")
            if fs.exists(url):
                fs.rm(url, recursive=True)


def random_tensor(
    dtype: torch.dtype, shape: tuple[int, ...] | list[int], seed: int
) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs and infinities included; bools are 0/1)."""
    shape = tuple(shape)
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(np.bool_))
    size = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(rng.bytes(math.prod(shape) * size))
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with default strides, keeping type and requires_grad."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t.detach().resolve_conj().resolve_neg())
    if type(t) is torch.nn.Parameter:
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(True) if t.requires_grad else out


def snapshot(value: Any) -> Any:
    """A deep copy of a state, sharing nothing with it."""
    if isinstance(value, torch.Tensor):
        return fresh(value)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return type(value)((k, snapshot(v)) for k, v in value.items())
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return copy.deepcopy(value)


def view_identity(value: torch.Tensor | np.ndarray) -> tuple[Any, ...]:
    """What makes two tensors one leaf of a checkpoint: the same view of the same storage, seen
    the same way. Two distinct tensor objects can be that (``t.view(a).view(b)`` of a ``b``
    tensor is a new object and the same view), so identity of the Python object is not enough."""
    if isinstance(value, np.ndarray) or not value.untyped_storage().nbytes():
        return ("object", id(value))
    return (
        value.untyped_storage().data_ptr(),
        value.dtype,
        value.storage_offset(),
        tuple(value.shape),
        value.stride(),
        type(value),
        value.requires_grad,
        value.is_conj(),
        value.is_neg(),
    )


def logical_bytes(value: Any, seen: set[tuple[Any, ...]] | None = None) -> int:
    """Tensor bytes of a live state, counting the same view of the same storage once."""
    seen = set() if seen is None else seen
    if isinstance(value, (torch.Tensor, np.ndarray)):
        key = view_identity(value)
        if key in seen:
            return 0
        seen.add(key)
        return (
            value.nbytes
            if isinstance(value, np.ndarray)
            else value.numel() * (value.element_size())
        )
    if isinstance(value, dict):
        return sum(logical_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(logical_bytes(v, seen) for v in value)
    return 0


def check_result(result: SaveResult, step: int, expected_logical: int) -> None:
    assert result.step == step
    assert result.bytes_logical == expected_logical
    assert result.chunks_reused + result.chunks_delta + result.chunks_full == result.chunks_total
    assert result.bytes_written > 0  # at least the manifest
    if result.full_base:
        assert result.chunks_delta == 0


def test_a_view_rebuilt_by_a_chain_of_views_is_counted_once(tmp_path: Any) -> None:
    """The shape of a failing random history: ``tied`` and ``t0`` start as one tensor, ``t0`` is
    reinterpreted as float32 and back, and is then a new object that is the same view as
    ``tied``. The store keeps one leaf for both; the expected count must agree."""
    tied = random_tensor(torch.complex32, (1, 1), seed=3)
    state = {"tied": tied, "t0": tied.view(torch.float32).view(torch.complex32)}
    assert state["t0"] is not tied
    with CheckpointStore(str(tmp_path / "store"), fsync=False) as store:
        result = store.save(state, 0).wait()
        assert result.bytes_logical == logical_bytes(state) == 4
        assert_state_equal(store.load(0), snapshot(state))


# ---------------------------------------------------------------- random nested states

plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=10),
)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.integers(0, 5)) == 0:
        shape: list[int] = [draw(st.integers(500, 3000))]  # spans many small chunks
    else:
        shape = draw(st.lists(st.integers(0, 20), max_size=3))
    t = random_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    form = draw(st.sampled_from(["plain", "plain", "T", "step", "param", "conj", "numpy"]))
    if form == "T" and t.dim() >= 2:
        return t.transpose(0, -1)
    if form == "step" and t.dim() >= 1:
        return t[::2]
    if form == "param" and dtype.is_floating_point:
        return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
    if form == "conj" and dtype.is_complex:
        return t.conj()
    if form == "numpy" and dtype in NUMPY_OK:
        return t.numpy()
    return t


nested = st.recursive(
    st.one_of(tensors(), plain),
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), c, max_size=4),
        st.dictionaries(st.text(max_size=4), c, max_size=3).map(OrderedDict),
    ),
    max_leaves=10,
)
states = st.dictionaries(st.text(max_size=5), nested, min_size=1, max_size=5)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    state=states,
    backend=st.sampled_from(["local", "memory"]),
    chunk_size=st.sampled_from([256, 1024]),
    pack_size=st.sampled_from([300, 4096]),
)
def test_random_nested_states_round_trip(
    state: dict, backend: str, chunk_size: int, pack_size: int
) -> None:
    expected = snapshot(state)
    with location(backend) as url:
        with CheckpointStore(url, chunk_size=chunk_size, pack_size=pack_size, fsync=False) as s:
            result = s.save(state, 7).wait()
            check_result(result, 7, logical_bytes(state))
            assert_state_equal(s.load(7), expected)
            assert_state_equal(s.load(), expected)
        with CheckpointStore(url) as reopened:
            assert reopened.steps() == [7]
            assert_state_equal(reopened.load(), expected)
            assert reopened.verify(7).ok


# ---------------------------------------------------------------- sequences of modifications


class Trainer:
    """A mutable state and the modifications a training run makes to it, drawn by hypothesis."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.counter = 0
        model: dict[str, Any] = {}
        for i in range(data.draw(st.integers(2, 5), label="tensors")):
            model[f"t{i}"] = self.new_tensor()
        model["frozen"] = random_tensor(torch.bfloat16, (40, 12), seed=1)
        self.state: dict[str, Any] = {
            "model": model,
            "optim": {"step": 0, "lr": 0.1, "betas": (0.9, 0.999), "m": [self.new_tensor()]},
            "meta": {"name": "run", "history": [1.5]},
            "tied": model["t0"],  # the same tensor twice: one leaf, while t0 is not replaced
            "np": np.arange(300, dtype=">i4"),
        }

    def seed(self) -> int:
        self.counter += 1
        return self.data.draw(st.integers(0, 2**32 - 1), label="seed") + self.counter

    def new_tensor(self) -> torch.Tensor:
        dtype = self.data.draw(st.sampled_from(DTYPES), label="dtype")
        rows = self.data.draw(st.integers(0, 48), label="rows")
        cols = self.data.draw(st.sampled_from([1, 3, 16, 64]), label="cols")
        return random_tensor(dtype, (rows, cols), self.seed())

    def pick(self) -> str:
        return self.data.draw(st.sampled_from(sorted(self.state["model"])), label="key")

    def modify(self) -> list[str]:
        ops = self.data.draw(
            st.lists(
                st.sampled_from(
                    [
                        "sparse",
                        "sparse",
                        "noise",
                        "noise",
                        "noise",
                        "frozen",
                        "dtype",
                        "reinterpret",
                        "shape",
                        "reshape",
                        "add",
                        "remove",
                        "rewrite",
                        "plain",
                        "optim",
                        "numpy",
                    ]
                ),
                min_size=1,
                max_size=3,
            ),
            label="ops",
        )
        for op in ops:
            getattr(self, f"op_{op}")()
        return ops

    # -- modifications (in place where training would modify in place)

    def op_sparse(self) -> None:
        t = self.state["model"][self.pick()]
        if t.dim() == 0 or t.shape[0] == 0:
            return
        rows = self.data.draw(
            st.lists(st.integers(0, t.shape[0] - 1), min_size=1, max_size=4), label="rows"
        )
        for r in rows:
            t[r] = random_tensor(t.dtype, t.shape[1:], self.seed())

    def op_noise(self) -> None:
        """Dense small change: flip the lowest bit of byte 0 of many of the elements."""
        t = self.state["model"][self.pick()]
        if t.numel() == 0:
            return
        density = self.data.draw(st.sampled_from([0.02, 0.2, 0.5]), label="density")
        mask = torch.from_numpy(np.random.default_rng(self.seed()).random(t.numel()) < density)
        elems = t.view(-1).view(torch.uint8).view(t.numel(), t.element_size())
        elems[:, 0] ^= mask.to(torch.uint8)

    def op_frozen(self) -> None:
        pass

    def op_dtype(self) -> None:
        key = self.pick()
        dtype = self.data.draw(st.sampled_from(DTYPES), label="new dtype")
        self.state["model"][key] = random_tensor(dtype, self.state["model"][key].shape, self.seed())

    def op_reinterpret(self) -> None:
        """Same bytes, another dtype of the same size (chunks are reused across dtypes)."""
        key = self.pick()
        t = self.state["model"][key]
        same = [
            d
            for d in DTYPES
            if d not in (torch.bool, t.dtype)
            and torch.empty((), dtype=d).element_size() == t.element_size()
        ]
        if t.dtype == torch.bool or not same or t.dim() == 0:
            return
        self.state["model"][key] = t.view(self.data.draw(st.sampled_from(same), label="as"))

    def op_shape(self) -> None:
        key = self.pick()
        t = self.state["model"][key]
        if t.dim() == 2 and self.data.draw(st.booleans(), label="grow"):
            extra = random_tensor(
                t.dtype, (self.data.draw(st.integers(1, 9)), t.shape[1]), self.seed()
            )
            self.state["model"][key] = torch.cat([t, extra])
        elif t.dim() >= 1 and t.shape[0] > 0:
            self.state["model"][key] = t[: self.data.draw(st.integers(0, t.shape[0] - 1))]

    def op_reshape(self) -> None:
        key = self.pick()
        t = self.state["model"][key]
        self.state["model"][key] = t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1, 1)

    def op_add(self) -> None:
        self.state["model"][f"new{self.seed() % 1000}"] = self.new_tensor()

    def op_remove(self) -> None:
        if len(self.state["model"]) > 1:
            del self.state["model"][self.pick()]

    def op_rewrite(self) -> None:
        key = self.pick()
        t = self.state["model"][key]
        self.state["model"][key] = random_tensor(t.dtype, t.shape, self.seed())

    def op_plain(self) -> None:
        meta = self.state["meta"]
        meta["history"].append(self.data.draw(st.floats(allow_nan=False), label="loss"))
        if self.data.draw(st.booleans(), label="rename"):
            meta["name"] = self.data.draw(st.text(max_size=8), label="name")

    def op_numpy(self) -> None:
        arr = self.state["np"]
        arr[self.data.draw(st.integers(0, arr.size - 1), label="index")] += 1

    def op_optim(self) -> None:
        optim = self.state["optim"]
        optim["step"] += 1
        optim["lr"] *= 0.5
        for m in optim["m"]:
            if m.numel():
                m.view(-1).view(torch.uint8)[0] ^= 1  # the lowest bit of the first element
        if self.data.draw(st.booleans(), label="more moments"):
            optim["m"].append(self.new_tensor())


def label_history(store: CheckpointStore) -> None:
    """Hypothesis events (see --hypothesis-show-statistics): what the history exercised."""
    stats = [json.loads(store.storage.get(mf.manifest_path(s)))["stats"] for s in store.steps()]
    event(f"delta chunks: {any(st_['chunks_delta'] for st_ in stats)}")
    event(f"full bases after the first: {sum(st_['full_base'] for st_ in stats[1:]) > 0}")
    event(f"reused chunks: {any(st_['chunks_reused'] for st_ in stats)}")


def restore_all(store: CheckpointStore, saved: dict[int, Any]) -> None:
    assert store.steps() == sorted(saved)
    for step, expected in saved.items():
        assert_state_equal(store.load(step), expected, f"step {step}")
    newest = max(saved)
    assert_state_equal(store.load(), saved[newest], f"newest (step {newest})")


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_step_of_a_random_history_restores_exactly(data: st.DataObject) -> None:
    backend = data.draw(st.sampled_from(["local", "memory"]), label="backend")
    options = {
        "chunk_size": data.draw(st.sampled_from([256, 1024]), label="chunk_size"),
        "pack_size": data.draw(st.sampled_from([512, 2048, 1 << 16]), label="pack_size"),
        "full_every": data.draw(st.sampled_from([1, 2, 2, 3, 3, 4]), label="full_every"),
        "max_chain": data.draw(st.sampled_from([0, 1, 2, 3, 3]), label="max_chain"),
        "max_chain_ratio": data.draw(st.sampled_from([1.0, 2.0, 16.0]), label="ratio"),
        "xor_base_memory": data.draw(st.sampled_from([None, None, None, 0, 3000]), label="xor mem"),
        "workers": data.draw(st.sampled_from([1, 2]), label="workers"),
        "max_in_flight": data.draw(st.sampled_from([1, 2]), label="in flight"),
        "codec_effort": data.draw(st.sampled_from(["auto", "auto", "fast"]), label="effort"),
        "fsync": False,
    }
    n_steps = data.draw(st.integers(2, 8), label="steps")
    trainer = Trainer(data)
    saved: dict[int, Any] = {}
    step = data.draw(st.integers(0, 3), label="first step")
    with location(backend) as url:
        store = CheckpointStore(url, **options)
        try:
            for i in range(n_steps):
                if i:
                    trainer.modify()
                    step += data.draw(st.integers(1, 3), label="gap")
                expected = snapshot(trainer.state)
                logical = logical_bytes(trainer.state)
                handle = store.save(trainer.state, step)
                saved[step] = expected
                if data.draw(st.booleans(), label="wait"):
                    check_result(handle.wait(), step, logical)
                if data.draw(st.integers(0, 4), label="reopen") == 0:
                    store.close()
                    store = CheckpointStore(url, **options)
                    if data.draw(st.booleans(), label="load after reopen"):
                        assert_state_equal(store.load(), saved[step])
            store.wait()
            label_history(store)
            restore_all(store, saved)
            newest = max(saved)
            assert store.verify(newest).ok
            store.close()

            # a fresh store on the same location sees the same history
            store = CheckpointStore(url, **options)
            restore_all(store, saved)

            if data.draw(st.booleans(), label="compact"):
                result = store.compact()
                if result is not None:
                    assert result.full_base and result.chunks_delta == 0
                    assert result.step == newest
                assert store.compact() is None  # the newest is now a full base
                restore_all(store, saved)
                # ... and the history continues on top of the compacted checkpoint
                trainer.modify()
                step += 1
                saved[step] = snapshot(trainer.state)
                check_result(
                    store.save(trainer.state, step).wait(), step, logical_bytes(trainer.state)
                )
                restore_all(store, saved)

            steps = sorted(saved)
            keep = data.draw(st.integers(1, len(steps)), label="keep_last")
            report = store.gc(keep_last=keep)
            kept, removed = steps[-keep:], steps[:-keep]
            assert report.kept_steps == kept
            assert report.removed_steps == removed
            for gone in removed:
                del saved[gone]
            with CheckpointStore(url, **options) as reopened:
                for check in (store, reopened):
                    restore_all(check, saved)
                    for gone in removed:
                        with pytest.raises(CheckpointNotFoundError):
                            check.load(gone)

            # continue after gc, on the same store or from a reopened one
            if data.draw(st.booleans(), label="reopen before continuing"):
                store.close()
                store = CheckpointStore(url, **options)
                if data.draw(st.booleans(), label="load before continuing"):
                    assert_state_equal(store.load(), saved[max(saved)])
            for _ in range(2):
                trainer.modify()
                step += 1
                saved[step] = snapshot(trainer.state)
                store.save(trainer.state, step)
            store.wait()
            restore_all(store, saved)
            with CheckpointStore(url) as reopened:
                restore_all(reopened, saved)
        finally:
            store.close()


def test_saving_on_after_another_store_compacted_and_collected(store_url: str) -> None:
    """Two CheckpointStore objects on one location: the training job's, which keeps saving, and a
    maintenance one that compacts the newest checkpoint and collects the rest. The job's next
    checkpoint must still restore: a save must not commit a manifest naming objects that are no
    longer in the store (the job's in-memory parent manifest is stale after the compaction)."""
    options = {"chunk_size": 256, "pack_size": 1024, "full_every": 10, "fsync": False}
    w = torch.arange(1024, dtype=torch.float32)
    with CheckpointStore(store_url, **options) as job:
        job.save({"w": w}, 1).wait()
        w[::7] += 1e-3
        job.save({"w": w}, 2).wait()  # XOR deltas against step 1
        with CheckpointStore(store_url, **options) as maintenance:
            assert maintenance.compact() is not None
            assert maintenance.gc(keep_last=1).removed_steps == [1]
        w[0] = 5.0
        expected = snapshot({"w": w})
        job.save({"w": w}, 3).wait()
        assert job.verify(3).ok, job.verify(3).errors[:3]
        assert_state_equal(job.load(3), expected)


# ---------------------------------------------------------------- byte counts


def manifest_size(store: CheckpointStore, step: int) -> int:
    return len(store.storage.get(mf.manifest_path(step)))


def test_an_unchanged_save_writes_under_one_percent(store_url: str) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {
            "w": torch.randn(1024, 1024, generator=g),
            "b": torch.randn(1024, generator=g),
            "emb": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        },
        "optim": {"step": 10, "m": [torch.randn(1024, 64, generator=g)]},
    }
    logical = logical_bytes(state)
    assert logical > 4 << 20
    expected = snapshot(state)
    with CheckpointStore(
        store_url, chunk_size=1 << 16, pack_size=1 << 20, full_every=3, fsync=False
    ) as store:
        first = store.save(state, 0).wait()
        assert first.chunks_reused == 0 and first.chunks_delta == 0
        assert first.bytes_written > logical // 2  # random data: the first save writes it all
        for step in range(1, 6):  # step 3 is a full base: unchanged chunks are still reused
            result = store.save(state, step).wait()
            check_result(result, step, logical)
            assert result.bytes_written / result.bytes_logical < 0.01, result
            assert result.chunks_reused == result.chunks_total
            assert result.chunks_delta == result.chunks_full == 0
            assert result.objects_written == 0
            assert result.bytes_written == manifest_size(store, step)
            assert result.full_base == (step % 3 == 0)
        for step in range(6):
            assert_state_equal(store.load(step), expected)


@pytest.mark.parametrize("change", ["new-values", "small-noise"])
def test_a_sparse_update_writes_about_the_changed_part(store_url: str, change: str) -> None:
    chunk = 1 << 14
    rows, cols = 256, chunk // 4  # one float32 row per chunk
    g = torch.Generator().manual_seed(1)
    state = {"emb": torch.randn(rows, cols, generator=g), "bias": torch.randn(cols, generator=g)}
    n_chunks = rows + math.ceil(cols * 4 / chunk)
    with CheckpointStore(
        store_url,
        chunk_size=chunk,
        pack_size=1 << 20,
        full_every=10,
        fsync=False,
        codec_effort="full",  # what the codec writes, not what a busy machine leaves it time for
    ) as store:
        store.save(state, 0).wait()
        changed = sorted(torch.randperm(rows, generator=g)[: rows // 20].tolist())  # 5%
        before = snapshot(state)
        if change == "new-values":
            state["emb"][changed] = torch.randn(len(changed), cols, generator=g)
        else:
            state["emb"][changed] *= 1 + 1e-6 * torch.randn(len(changed), cols, generator=g)
        assert (state["emb"][changed] != before["emb"][changed]).any(dim=1).all()
        expected = snapshot(state)
        result = store.save(state, 1).wait()
        check_result(result, 1, logical_bytes(state))
        changed_bytes = len(changed) * chunk
        assert result.chunks_total == n_chunks
        assert result.chunks_reused == n_chunks - len(changed)
        assert result.chunks_delta + result.chunks_full == len(changed)
        assert result.bytes_written <= 2 * changed_bytes + manifest_size(store, 1), result
        if change == "small-noise":
            # the XOR against the previous snapshot is much smaller than the chunk
            assert result.chunks_delta == len(changed)
            assert result.bytes_written - manifest_size(store, 1) < changed_bytes * 0.8
        else:
            assert result.bytes_written - manifest_size(store, 1) > changed_bytes // 2
        assert_state_equal(store.load(1), expected)
        assert_state_equal(store.load(0), before)
    with CheckpointStore(store_url) as reopened:
        assert_state_equal(reopened.load(1), expected)


# ---------------------------------------------------------------- snapshot isolation


class GatedStorage(Storage):
    """Delegates to a real storage; every write waits until ``gate`` is set, so a save is
    certainly still running while the test mutates the state it was given."""

    def __init__(self, inner: Storage, gate: threading.Event) -> None:
        self.inner, self.gate, self.url = inner, gate, inner.url

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        assert self.gate.wait(30), "test gate never opened"
        return self.inner.put(path, data, overwrite=overwrite)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(path, start, end)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def mtime(self, path: str) -> float | None:
        return self.inner.mtime(path)


def mutate_everything(state: dict[str, Any]) -> None:
    state["w"].add_(1.0)
    state["ints"].zero_()
    state["param"].data.mul_(2)
    state["view"].fill_(7.0)  # a view into state["w"]
    state["np"][:] = 9
    state["list"].append(torch.ones(3))
    state["list"][0].neg_()
    state["nested"]["k"] = "changed"
    state["nested"]["t"].copy_(torch.arange(10) * 3)
    state["new"] = torch.zeros(5)


def test_mutating_the_state_after_save_returns_changes_nothing_saved(store_url: str) -> None:
    gate = threading.Event()
    storage = GatedStorage(open_storage(store_url, None), gate)
    w = torch.randn(64, 32)
    state: dict[str, Any] = {
        "w": w,
        "view": w[3:5, ::2],
        "ints": torch.arange(300),
        "param": torch.nn.Parameter(torch.randn(17)),
        "np": np.arange(50, dtype=np.float32),
        "list": [torch.randn(40)],
        "nested": {"k": "v", "t": torch.arange(10)},
    }
    store = CheckpointStore(storage, chunk_size=256, pack_size=1024, max_in_flight=3, fsync=False)
    try:
        expected0 = snapshot(state)
        h0 = store.save(state, 0)
        mutate_everything(state)
        expected1 = snapshot(state)
        h1 = store.save(state, 1)
        mutate_everything(state)
        assert not h0.done() and not h1.done()  # the gate held both saves back
        gate.set()
        h0.wait()
        h1.wait()
        assert_state_equal(store.load(0), expected0)
        assert_state_equal(store.load(1), expected1)
    finally:
        gate.set()
        store.close()
    with CheckpointStore(store_url) as reopened:
        assert_state_equal(reopened.load(0), expected0)
        assert_state_equal(reopened.load(1), expected1)
