"""The snapshot of many small tensors: one copy per dtype into a recycled slab, no garbage
collection during the walk, and leaves that hold exactly what a copy of each tensor would."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.errors import UnsupportedValueError
from lightning_incremental.core.save import slabs as slabs_module
from lightning_incremental.core.save.slabs import (
    BATCH_FIRST,
    BATCH_MAX,
    FRESH_THREAD_MIN,
    SLAB_MAX,
    THREAD_FROM,
)
from lightning_incremental.core.save.snapshot import flatten, flatten_state, wait_ready
from tests.engine.gc_counts import collections_started


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _batches(n: int) -> list[int]:
    """The batches ``n`` small tensors of one dtype, walked alone, are cut into."""
    sizes, limit = [], BATCH_FIRST
    while n >= limit:
        sizes.append(limit)
        n -= limit
        limit = min(2 * limit, BATCH_MAX)
    return sizes + ([n] if n else [])


def _to_the_thread() -> int:
    """Small tensors of one dtype enough that the copying thread copies their last batch
    (whatever their memory: from :data:`THREAD_FROM` tensors cut)."""
    total = 0
    for size in _batches(1 << 20):
        total += size
        if total >= THREAD_FROM:
            return total
    raise AssertionError("unreachable")


def test_the_batches_grow_in_number_linearly_with_the_tensors() -> None:
    assert _batches(200) == [200]
    assert _batches(2000) == [512, 1024, 464]
    assert _batches(BATCH_FIRST + 2 * BATCH_MAX + 100) == [512, 1024, 2048, 4096, 1124]
    assert len(_batches(100_000)) == 3 + (100_000 - 3584) // BATCH_MAX + 1


def _many(n: int) -> dict[str, Any]:
    return {
        "model": {f"w{i}": torch.full((64,), float(i)) for i in range(n)},
        "half": {f"h{i}": torch.full((8,), float(i), dtype=torch.bfloat16) for i in range(n)},
    }


@pytest.mark.parametrize("n", [200, 2000])
def test_tensor_operations_grow_with_the_batches_not_the_tensors(n: int) -> None:
    """Copying one tensor at a time is a dispatched copy per tensor; the slabs make it one
    ``cat`` per batch of a dtype (see :func:`_batches`), however small the tensors."""
    state = _many(n)
    with _CountOps() as counted:
        flat = flatten_state(state, pool=BufferPool())
    # per batch: a slab (empty, zero_ to fault in the last), a view of it as the dtype, a cat
    batches = len(_batches(n)) + 1  # the float32 tensors', then the bfloat16 ones in one
    assert counted.ops["cat"] == batches
    assert sum(counted.ops.values()) <= 5 * batches, counted.ops
    wait_ready(flat)
    assert len(flat.leaves) == 2 * n


def test_the_walk_triggers_no_garbage_collection() -> None:
    """Every tensor of the walk makes a few small objects; collections triggered by them only
    scanned the same objects again (half the time ``save`` blocked at 20,000 tensors)."""
    state = _many(3000)
    with collections_started() as collections:
        flatten_state(state, pool=BufferPool())
    # at most one, once collection is back on (it was one per few hundred objects made)
    assert len(collections) <= 1, collections
    assert gc.isenabled()


def test_what_the_walk_made_is_not_left_for_the_next_young_collection() -> None:
    """Resumed with every object of the walk young, the first collection after it (on the
    training thread, once ``save`` returned) scanned them all, and the next older one again:
    they are promoted to the oldest generation, where only a full collection looks."""
    state = _many(3000)
    gc.collect()
    flat = flatten_state(state, pool=BufferPool())
    young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
    assert young < 1000, young  # the walk made about 25,000
    assert flat.leaves and gc.isenabled()


def test_a_freeze_made_by_someone_else_is_left_as_it_is() -> None:
    gc.freeze()  # a server that froze its objects before forking workers
    try:
        frozen = gc.get_freeze_count()
        flatten_state(_many(100), pool=BufferPool())
        # not unfrozen (0), nor frozen again (the young objects would join: the count grows);
        # a frozen object that died by reference count meanwhile (an earlier test's) leaves it
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_collection_stays_off_when_the_caller_turned_it_off() -> None:
    gc.disable()
    try:
        flatten_state(_many(10))
        assert not gc.isenabled()
    finally:
        gc.enable()


def _odd_state() -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    param = torch.nn.Parameter(torch.randn(3, 4))
    return {
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(10, dtype=torch.int64).view(2, 5),
        "bools": torch.tensor([True, False, True]),
        "complex": torch.randn(4, dtype=torch.complex64),
        "strided": base[:, ::2],  # not contiguous
        "transposed": base.t(),
        "param": param,
        "same_param": param,  # one leaf
        "detached": param.detach(),  # another view: its own leaf (requires_grad differs)
        "row": base[1],  # same storage, another view: its own leaf
        "big": torch.randn(SLAB_MAX // 4 + 1),  # past the slab size: copied on its own
        "empty": torch.empty(0, 3),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),  # a conjugate view
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag,  # a negative view
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
    }


def test_leaves_hold_exactly_each_tensor_as_seen() -> None:
    state = _odd_state()
    _, leaves, _ = flatten(state)
    by_path = {leaf.path: leaf for leaf in leaves}
    for key, value in state.items():
        leaf = by_path.get(f"state[{key!r}]")
        if key == "same_param":
            assert leaf is None  # the same tensor: one leaf, at its first path
            continue
        assert leaf is not None, key
        assert leaf.data.is_contiguous()
        assert leaf.shape == list(value.shape)
        assert leaf.data.dtype == value.dtype
        assert torch.equal(leaf.data, value.detach().resolve_conj().resolve_neg()), key
        assert leaf.requires_grad == value.requires_grad
        assert leaf.parameter == isinstance(value, torch.nn.Parameter)
    assert [leaf.slot for leaf in leaves] == sorted(leaf.slot for leaf in leaves)


def test_small_tensors_keep_their_key_paths_wherever_they_sit() -> None:
    """A dict's tensors are noted with the dict's path and their key (no path of their own is
    built during the walk); the key path each leaf gets is the one a path built in full gives."""
    state = {
        "m": {"a": torch.ones(2), 3: torch.ones(3), (1, "x"): torch.ones(4)},
        "l": [torch.ones(5), {"deep": torch.ones(6)}],
        "t": (torch.ones(7),),
    }
    _, leaves, _ = flatten(state)
    assert sorted(leaf.path for leaf in leaves) == sorted(
        [
            "state['m']['a']",
            "state['m'][3]",
            "state['m'][(1, 'x')]",
            "state['l'][0]",
            "state['l'][1]['deep']",
            "state['t'][0]",
        ]
    )
    _, (alone,), _ = flatten(torch.arange(3.0))
    assert alone.path == "state" and torch.equal(alone.data, torch.arange(3.0))


def test_changes_after_save_returns_are_not_saved(tmp_path: Any) -> None:
    """The snapshot is taken when ``save`` returns: later in-place changes, a new shape or a
    flag turned off go into the next save only."""
    state = {"w": {f"t{i}": torch.full((16,), float(i)) for i in range(50)}}
    p = torch.nn.Parameter(torch.ones(4, 4))
    state["p"] = p
    expected = {k: v.clone() for k, v in state["w"].items()}
    with CheckpointStore(tmp_path / "s") as store:
        handle = store.save(state, step=1)
        for t in state["w"].values():
            t.add_(100)
        state["w"]["t0"].resize_(2)
        p.requires_grad_(False)
        handle.result()
        restored = store.load(step=1)
    for key, value in expected.items():
        assert torch.equal(restored["w"][key], value)
    assert torch.equal(restored["p"], torch.ones(4, 4))
    assert restored["p"].requires_grad


def test_a_round_trip_of_odd_tensors_through_the_store(tmp_path: Any) -> None:
    state = _odd_state()
    with CheckpointStore(tmp_path / "s") as store:
        store.save(state, step=1).result()
        restored = store.load(step=1)
    for key, value in state.items():
        want = value.detach().resolve_conj().resolve_neg()
        got = restored[key].resolve_conj().resolve_neg()
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    assert restored["param"] is restored["same_param"]


@contextlib.contextmanager
def _slabs_lent() -> Iterator[list[int]]:
    """The address of every slab a pool lends meanwhile, in order."""
    lent: list[int] = []
    original = BufferPool.lend_slab

    def spy(self: BufferPool, nbytes: int, sizes: list[int], **kwargs: Any) -> torch.Tensor:
        slab = original(self, nbytes, sizes, **kwargs)
        lent.append(slab.data_ptr())
        return slab

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(BufferPool, "lend_slab", spy)
        yield lent


def test_a_steady_save_reuses_the_slab_memory(tmp_path: Any) -> None:
    """The slab of a save comes back to the pool once the next save replaced it as the delta
    base, and the save after that copies into it: no new memory per save."""
    state = {"w": {f"t{i}": torch.randn(32) for i in range(300)}}
    with _slabs_lent() as lent, CheckpointStore(tmp_path / "s") as store:
        for step in range(1, 6):
            for t in state["w"].values():
                t.add_(1)
            store.save(state, step=step).result()
    assert len(lent) == 5
    assert len(set(lent)) <= 2, lent  # the snapshot's slab and the delta base's, in turn


def test_the_pool_takes_a_slab_back_once_every_leaf_came_back() -> None:
    pool = BufferPool()
    slab = pool.lend_slab(48, [16, 16, 16])
    parts = [slab[i : i + 16].view(torch.float32) for i in (0, 16, 32)]
    pool.give(parts[:2])
    pool.give(parts[:1])  # given twice: counted once
    assert pool.nbytes == 0
    pool.give(parts[2:])
    assert pool.nbytes == 48
    again = pool.lend_slab(48, [48])
    assert again.data_ptr() == slab.data_ptr()
    pool.give([torch.empty(100)[10:20]])  # a view the pool did not lend: ignored
    assert pool.nbytes == 0


# ----------------------------------------------------------------- copies beside the walk


def _mixed(n: int) -> dict[str, Any]:
    """``n`` float32 tensors of odd shapes, some views, some parameters (they require grad,
    which ``torch.cat`` with ``out=`` refuses outside ``no_grad``), and ``n // 4`` bfloat16
    ones."""
    torch.manual_seed(1)
    base = torch.randn(n, 6)

    def one(i: int) -> torch.Tensor:
        if i % 5 == 0:
            return base[i, ::2]
        if i % 5 == 1:
            return torch.nn.Parameter(torch.randn(i % 4 + 1))
        return torch.randn(i % 7 + 1, 3)

    return {
        "f": {f"w{i}": one(i) for i in range(n)},
        "b": [torch.randn(i % 3 + 1).to(torch.bfloat16) for i in range(n // 4)],
    }


def test_a_large_state_is_copied_in_batches_on_another_thread_as_the_walk_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From :data:`THREAD_FROM` tensors of a dtype, batches go to the copying thread as the
    walk notes them (their number grows linearly, by :data:`BATCH_MAX`); the batches before
    (small ones, here) the walk copies itself. Every leaf still holds exactly its tensor as
    seen."""
    n = BATCH_FIRST + 2 * BATCH_MAX + 100  # float32: 512, 1024, 2048, 4096, the rest
    state = _mixed(n)
    cats: list[tuple[str, int]] = []
    original = torch.cat

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        cats.append((threading.current_thread().name, len(tensors)))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counted)
    pool = BufferPool()
    flat = flatten_state(state, pool=pool)
    monkeypatch.setattr(torch, "cat", original)
    wait_ready(flat)
    on_thread = [size for name, size in cats if name == "snapshot-slab-copy"]
    cut = _batches(n)
    assert cut[2] + cut[1] + cut[0] >= THREAD_FROM > cut[1] + cut[0]
    assert on_thread == cut[2:4], cats
    assert sorted(size for _, size in cats) == sorted([*cut, n // 4])
    assert not [t for t in threading.enumerate() if t.name == "snapshot-slab-copy"]
    leaves = {leaf.path: leaf for leaf in flat.leaves}
    for i, value in enumerate(state["f"].values()):
        leaf = leaves[f"state['f']['w{i}']"]
        assert leaf.shape == list(value.shape) and torch.equal(leaf.data, value.detach()), i
        assert leaf.requires_grad == value.requires_grad, i
    for i, value in enumerate(state["b"]):
        assert torch.equal(leaves[f"state['b'][{i}]"].data, value), i


def test_conjugate_and_negative_views_are_copied_into_the_slab_as_they_show() -> None:
    """The walk reads neither bit: ``torch.cat`` writes what a view shows, so a conjugate or a
    negative view is a small tensor like any other, beside the tensor it views (the same
    memory seen another way: a leaf of its own)."""
    c = torch.randn(5, dtype=torch.complex64)
    state = {"c": c, "conj": c.conj(), "imag": c.imag, "neg": c.conj().imag}
    _, leaves, _ = flatten(state)
    by_key = {leaf.path: leaf for leaf in leaves}
    assert len(by_key) == 4
    for key, value in state.items():
        leaf = by_key[f"state[{key!r}]"]
        assert leaf.slab is not None, key  # type: ignore[attr-defined]
        assert not leaf.data.is_conj() and not leaf.data.is_neg(), key
        assert torch.equal(leaf.data, value.resolve_conj().resolve_neg()), key
    assert torch.equal(by_key["state['neg']"].data, -c.imag)


def _copied_on_the_thread(state: Any, pool: BufferPool) -> tuple[list[int], list[int], Any]:
    """The sizes of the batches the copying thread and the walk copied, and the snapshot."""
    cats: list[tuple[str, int]] = []
    original = torch.cat

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        cats.append((threading.current_thread().name, len(tensors)))
        return original(tensors, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(torch, "cat", counted)
        flat = flatten_state(state, pool=pool)
    wait_ready(flat)
    thread = [n for name, n in cats if name == "snapshot-slab-copy"]
    return thread, [n for name, n in cats if name != "snapshot-slab-copy"], flat


def test_batches_of_fresh_memory_are_copied_on_the_thread_recycled_ones_by_the_walk() -> None:
    """Below :data:`THREAD_FROM` tensors, a batch whose slab is fresh memory (a store's first
    saves: a page fault per page, about the copy's own time) is copied on the copying thread
    while the walk goes on; once the slabs came back, the same batches are copied by the walk
    itself, into memory faulted in already (a thread would cost more than it hides)."""
    n = 2000  # of 4 KiB: batches of 2 MiB, 4 MiB and the rest
    assert _batches(n)[0] * 4096 >= FRESH_THREAD_MIN and sum(_batches(n)[:2]) < THREAD_FROM
    state = {"w": {f"t{i}": torch.full((1024,), float(i)) for i in range(n)}}
    pool = BufferPool()
    thread, walk, flat = _copied_on_the_thread(state, pool)
    assert thread == _batches(n)[:2] and walk == _batches(n)[2:]
    leaves = flat.leaves
    for i, value in enumerate(state["w"].values()):
        assert torch.equal(leaves[i].data, value), i
    pool.give_slabs(list({id(leaf.slab): leaf.slab for leaf in leaves}.values()))
    assert all(pool.recycles(size * 4096) for size in _batches(n))
    thread, walk, flat = _copied_on_the_thread(state, pool)
    assert thread == [] and walk == _batches(n)
    assert not pool.nbytes  # every slab lent again
    for i, value in enumerate(state["w"].values()):
        assert torch.equal(flat.leaves[i].data, value), i
    small = {"w": [torch.ones(4) for _ in range(n)]}  # fresh, but 8 KiB a batch: no thread
    assert _copied_on_the_thread(small, BufferPool())[0] == []


def test_a_walk_that_fails_after_hand_offs_gives_their_slabs_back() -> None:
    """An unsupported value after thousands of tensors: the batches handed off are waited
    for and their slabs go back to the pool; no copying thread is left."""
    state = {"w": [torch.ones(4) for _ in range(BATCH_FIRST + BATCH_MAX + 5)], "z": object()}
    pool = BufferPool()
    with pytest.raises(UnsupportedValueError, match=r"state\['z'\]"):
        flatten_state(state, pool=pool)
    assert not pool._lent
    assert pool.nbytes == sum(_batches(BATCH_FIRST + BATCH_MAX + 5)[:3]) * 16  # cut, free
    assert not [t for t in threading.enumerate() if t.name == "snapshot-slab-copy"]


def test_a_copy_that_fails_on_the_copying_thread_fails_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = torch.cat

    def failing(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread().name == "snapshot-slab-copy":
            raise RuntimeError("copy failed on the copying thread")
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", failing)
    pool = BufferPool()
    with pytest.raises(RuntimeError, match="copying thread"):
        flatten_state({"w": [torch.ones(4) for _ in range(_to_the_thread() + 10)]}, pool=pool)
    assert not pool._lent and pool.nbytes == (_to_the_thread() + 10) * 16


def test_steady_saves_of_a_large_state_recycle_their_batch_slabs(tmp_path: Any) -> None:
    """Each save cuts the same batches, so the slabs of two saves ago come back at the same
    sizes: the memory lent stops growing after the second save."""
    state = {"w": {f"t{i}": torch.randn(8) for i in range(BATCH_FIRST + BATCH_MAX + 7)}}
    with _slabs_lent() as lent, CheckpointStore(tmp_path / "s") as store:
        for step in range(1, 6):
            for t in list(state["w"].values())[::50]:
                t.add_(1)
            store.save(state, step=step).result()
            if step == 2:
                after_two = set(lent)
        restored = store.load(step=5)
    assert len(lent) == 5 * len(_batches(BATCH_FIRST + BATCH_MAX + 7))  # its batches, each save
    assert set(lent) == after_two, "a steady save lent new memory"
    for key, value in state["w"].items():
        assert torch.equal(restored["w"][key], value)


def test_a_large_state_saved_in_inference_mode_and_out_of_it_restores_exactly(
    tmp_path: Any,
) -> None:
    """Lightning saves from its validation loop under ``torch.inference_mode`` and from its
    training loop outside it: buffers allocated in one mode are written in the other (by the
    save, and by the copying thread, which runs in neither), so they are normal tensors."""
    state = {"w": [torch.randn(4) for _ in range(BATCH_FIRST + 300)], "big": torch.randn(1 << 18)}
    with CheckpointStore(tmp_path / "s") as store:
        for step, inference in enumerate([True, False, False, True, False, True], start=1):
            for t in state["w"][::9]:
                t.add_(1)
            state["big"].add_(1)
            with torch.inference_mode(inference):
                store.save(state, step=step).result()
            restored = store.load(step=step)
            assert all(torch.equal(a, b) for a, b in zip(restored["w"], state["w"])), step
            assert torch.equal(restored["big"], state["big"]), step


def test_an_interrupt_while_the_walk_waits_for_the_copies_gives_no_slab_back_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C as the walk waits for the copying thread: the interrupt is raised once the
    thread has ended, and only then do the slabs go back to the pool (given back earlier, the
    next save would be lent a slab the thread still writes into)."""
    release = threading.Event()
    original = torch.cat
    copying = {"ended": False}

    def slow(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread().name == "snapshot-slab-copy":
            release.wait(10)
            out = original(tensors, *args, **kwargs)
            copying["ended"] = True
            return out
        return original(tensors, *args, **kwargs)

    class InterruptedOnce(threading.Event):
        calls = 0

        def wait(self, timeout: float | None = None) -> bool:
            InterruptedOnce.calls += 1
            if InterruptedOnce.calls == 1:  # the walk's first wait for the thread: a Ctrl-C
                threading.Timer(0.3, release.set).start()
                raise KeyboardInterrupt
            return super().wait(timeout)

    started = slabs_module._Copier.__init__

    def start(self: Any) -> None:
        started(self)
        self.ended = InterruptedOnce()  # what finish() waits on; the thread sets it as it ends

    monkeypatch.setattr(torch, "cat", slow)
    monkeypatch.setattr(slabs_module._Copier, "__init__", start)
    pool = BufferPool()
    with pytest.raises(KeyboardInterrupt):
        flatten_state({"w": [torch.ones(4) for _ in range(_to_the_thread() + 10)]}, pool=pool)
    assert copying["ended"], "raised while the copying thread still wrote into a lent slab"
    assert not pool._lent and pool.nbytes == (_to_the_thread() + 10) * 16
    assert not [t for t in threading.enumerate() if t.name == "snapshot-slab-copy"]


def test_a_failed_walk_gives_the_memory_tiers_fallback_slabs_back(tmp_path: Any) -> None:
    """With a memory tier's slot too small for the batches, the slabs come from its fallback
    pool, and a failed walk gives them back there (not to the slot, which never lent them)."""
    from lightning_incremental.runtime.memory.slots import Slot, SlotPool

    fallback = BufferPool()
    pool = SlotPool(Slot(tmp_path / "slot", 1024), fallback)
    state = {"w": [torch.ones(4) for _ in range(BATCH_FIRST + 5)], "z": object()}
    with pytest.raises(UnsupportedValueError):
        flatten_state(state, pool=pool)
    assert not fallback._lent
    assert fallback.nbytes == BATCH_FIRST * 16  # the batch handed off; the rest never lent
