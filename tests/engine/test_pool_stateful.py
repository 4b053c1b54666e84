"""A stateful property test of stores sharing an object pool, and forks, under collection and
faults.

Hypothesis drives several stores — members of two pools, plain stores, forks of either (into
the source's pool, the other pool, or none, forks of forks, whole or of weights only: the step
as the fork's delta base) — through random sequences of: save (after a load, so that chunks
are referenced, not written), a manifest write that fails before or after it landed, a pool gc
in the middle of a save (between its objects and its manifest), member gc with any
``keep_last`` and no minimum age, delete, compaction, unpin, time passing (every object older
than any minimum age), pool gc with or without a minimum age, or while a member's listing or
the pool's trash listing fails (refused, nothing moved or purged), and a pool gc that a member
races: between the collection's reading of an unreferenced object's age and its removal of that
object (a move to the pool's trash), the member saves the same bytes again and commits; and a
member of either pool deleted for good (its location removed, its record left), forks of it or
not, before or after they saved.

Invariant, after every step, for every store: each visible step was saved (or forked) and
restores its exact bytes — no visible step of any member ever loses an object — and a fork of
weights only that holds no checkpoint yet loads its fork base.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lightning_incremental.core import CheckpointError, CheckpointStore, ConfigError
from lightning_incremental.core.commit.history import FORK_BASE
from lightning_incremental.core.maintain.pool import leave, unpin
from lightning_incremental.core.maintain.pool_gc import PoolMemberError, collect_pool
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage
from tests.conftest import DEEP, assert_state_equal
from tests.faulty import FaultyStorage, unreadable_directories

OPTIONS: dict[str, Any] = {
    "chunk_size": 1024,
    "pack_size": 4096,
    "full_every": 3,
    "fsync": False,
    "workers": 1,
    "min_object_age_s": 0.0,
}
MAX_STORES = 9
BACKBONE = torch.randn(16, 256, generator=torch.Generator().manual_seed(7))  # frozen, shared


class Intercept(FaultyStorage):
    """Runs ``before_manifest`` once, on the save's thread, just before its manifest write."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.before_manifest: Any = None

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        hook, self.before_manifest = self.before_manifest, None
        if hook is not None and path.startswith("manifests/"):
            hook()
        elif hook is not None:
            self.before_manifest = hook
        return super().put(path, data, overwrite=overwrite)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.expected: dict[str, dict[int, dict[str, Any]]] = {}  # store -> step -> state
        self.next_step: dict[str, int] = {}
        self.forks: list[tuple[str, str]] = []  # (source, fork)
        self.bases: dict[str, dict[str, Any]] = {}  # a fork of weights only -> its first state
        self.refusals = 0
        self.made = 0  # forks made: their names

    @initialize(root=st.just(None))
    def start(self, root: None) -> None:
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="li-pool-"))
        self.pool = str(self.root / "pool")
        self.pool2 = str(self.root / "pool2")
        pools = {"m": self.pool, "n": self.pool2, "p": None}
        for name in ("m0", "m1", "n0", "p0", "p1"):
            self.expected[name] = {}
            self.next_step[name] = 1
            self.open(name, pool=pools[name[0]]).close()

    def remove(self) -> None:
        if hasattr(self, "root"):
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, name: str) -> str:
        return str(self.root / name)

    def open(self, name: str, pool: str | None = None, **extra: Any) -> CheckpointStore:
        return CheckpointStore(self.url(name), pool=pool, **{**OPTIONS, **extra})

    def pool_objects(self) -> dict[str, float]:
        """The pool's objects and trash entries (and markers), with their times."""
        found: dict[str, float] = {}
        for under in ("packs", "trash"):
            base = Path(self.pool, under)
            if base.exists():
                found.update({str(p): p.stat().st_mtime for p in base.rglob("*") if p.is_file()})
        return found

    # ------------------------------------------------------------------ rules

    @rule(
        data=st.data(),
        change=st.sampled_from(["head", "backbone"]),
        disturb=st.sampled_from(["none", "none", "pool_gc", "fail_before", "fail_after"]),
    )
    def save(self, data: st.DataObject, change: str, disturb: str) -> None:
        for name in data.draw(
            st.lists(st.sampled_from(sorted(self.expected)), min_size=1, max_size=3)
        ):
            self.save_one(name, change, disturb)

    def save_one(self, name: str, change: str, disturb: str) -> None:
        step = self.next_step[name]
        self.next_step[name] += 1
        storage = Intercept(open_storage(self.url(name), None))
        store = CheckpointStore(storage, **OPTIONS)
        try:
            state: dict[str, Any]
            if store.steps():
                state = store.load()
            elif name in self.bases:  # a fork of weights only starts from its source's step
                state = {"model": {k: v.clone() for k, v in self.bases[name]["model"].items()}}
            else:
                # a head of its own: what a store loses is not kept by another's equal bytes
                head = torch.full((64,), float(sum(map(ord, name))))
                state = {"model": {"backbone": BACKBONE.clone(), "head": head}}
            state = {"model": dict(state["model"]), "step": step}
            state["model"]["head"] = state["model"]["head"] + step
            if change == "backbone":
                state["model"]["backbone"] = state["model"]["backbone"].clone()
                state["model"]["backbone"][step % 16] += 1.0
            if disturb == "pool_gc":  # objects written, manifest not yet: they are young
                storage.before_manifest = lambda: collect_pool(self.pool, min_age_s=900.0)
            elif disturb != "none":
                storage.fail("manifest", when=disturb.removeprefix("fail_"))
            try:
                store.save(state, step).wait()
            except CheckpointError:
                assert disturb.startswith("fail_")
        finally:
            storage.clear()
            try:
                store.close()
            except CheckpointError:
                pass
        with self.open(name) as again:
            if step in again.steps():
                self.expected[name][step] = state

    @rule(data=st.data(), keep=st.integers(1, 3))
    def gc(self, data: st.DataObject, keep: int) -> None:
        self.member_gc(data.draw(st.sampled_from(sorted(self.expected))), keep)

    def member_gc(self, name: str, keep: int) -> None:
        with self.open(name) as store:
            store.gc(keep_last=keep)
            self.forget(name, store.steps())

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.expected)))
        with self.open(name) as store:
            steps = store.steps()
            if steps:
                store.delete(data.draw(st.sampled_from(steps)))
            self.forget(name, store.steps())

    @rule(data=st.data())
    def compact(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.expected)))
        with self.open(name) as store:
            if store.steps():
                store.compact()
                store.gc()

    @precondition(lambda self: len(self.expected) < MAX_STORES)
    @rule(
        data=st.data(),
        into=st.sampled_from(["default", "pool", "pool2", "plain"]),
        whole=st.sampled_from([True, True, False]),
    )
    def fork(self, data: st.DataObject, into: str, whole: bool) -> None:
        """Fork a recent step: whole (the step is the fork's), or as its delta base (a run
        that starts again on those weights, numbering its own steps)."""
        sources = sorted(n for n, steps in self.expected.items() if steps)
        if not sources:
            return
        src = data.draw(st.sampled_from(sources))
        step = data.draw(st.sampled_from(sorted(self.expected[src])[-2:]))  # not just 1
        dst = f"f{self.made}"
        self.made += 1
        pool = {"pool": self.pool, "pool2": self.pool2}.get(into)
        CheckpointStore.fork(
            self.url(src), self.url(dst), step, pool=pool, min_age_s=0.0, as_base=not whole
        )
        if whole:
            self.expected[dst] = {step: self.expected[src][step]}
            self.next_step[dst] = self.next_step[src]
        else:
            self.expected[dst], self.next_step[dst] = {}, 1
            self.bases[dst] = self.expected[src][step]
        self.forks.append((src, dst))

    @precondition(lambda self: bool(self.forks))
    @rule(data=st.data(), change=st.sampled_from(["head", "backbone"]))
    def source_moves_on(self, data: st.DataObject, change: str) -> None:
        """A forked store saves past its chains' length and keeps only its newest step."""
        src, _ = data.draw(st.sampled_from(self.forks))
        for _ in range(OPTIONS["full_every"] + 1):
            self.save_one(src, change, "none")
        self.member_gc(src, 1)

    @precondition(lambda self: bool(self.forks))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        src, dst = data.draw(st.sampled_from(self.forks))
        try:
            unpin(self.url(src), self.url(dst))
        except ConfigError:
            return  # the fork still needs its source: refused
        self.forks.remove((src, dst))

    @rule(data=st.data())
    def drop_member(self, data: st.DataObject) -> None:
        """A member of a pool (a fork or not) is deleted for good: its location removed, its
        record then removed from its pool, and the pool collected. Its forks keep what they
        need: in its pool by their own manifests and fork bases, in another pool by the copy
        they made, in a plain store by their own pins."""
        pooled = {}
        for name in sorted(self.expected):
            found = self.root / name / "links.json"
            pool = json.loads(found.read_bytes())["pool"] if found.exists() else None
            if pool is not None:
                pooled[name] = pool
        if not pooled:
            return
        name = data.draw(st.sampled_from(sorted(pooled)))
        shutil.rmtree(self.root / name)
        leave(pooled[name], self.url(name))
        for _ in range(2):  # then its pool collected: what it alone named moved, then purged
            collect_pool(pooled[name], min_age_s=0.0)
        del self.expected[name]
        self.bases.pop(name, None)
        self.forks = [(src, dst) for src, dst in self.forks if src != name]

    @rule()
    def age(self) -> None:
        """Time passes: every object (and every trash entry) is older than any minimum age."""
        then = time.time() - 10_000
        for pattern in ("*.pack", "*.moved"):
            for path in self.root.rglob(pattern):
                os.utime(path, (then, then))

    @rule()
    def pool_gc_racing_a_save(self) -> None:
        """A pooled store saves a state and deletes it (its objects are unreferenced and, once
        aged, old); a collection reads the age of one of them and, before it removes it, the
        store saves the same state again (the same objects, written again) and commits."""
        name = "race"
        self.expected.setdefault(name, {})
        first = self.next_step.get(name, 1)
        self.next_step[name] = first + 2
        head = torch.full((64,), float(first))
        state = {"model": {"backbone": BACKBONE.clone(), "head": head}, "step": -1}
        with self.open(name, pool=self.pool) as store:
            for step in store.steps():
                store.delete(step)  # none visible: the next save is a full one, the same bytes
            self.forget(name, [])
            store.save(state, first).wait()
            written = set(store.manifest(first).packs)
            store.delete(first)
        self.age()
        real, armed, pool = LocalStorage.mtime, [True], os.path.normpath(self.pool)

        def mtime(storage: LocalStorage, path: str) -> float | None:
            found = real(storage, path)  # the age check; the removal follows
            if armed and path in written and os.path.normpath(storage.root) == pool:
                armed.clear()
                with self.open(name) as again:
                    again.save(state, first + 1).wait()
            return found

        LocalStorage.mtime = mtime  # type: ignore[method-assign]
        try:
            collect_pool(self.pool, min_age_s=900.0)
        finally:
            LocalStorage.mtime = real  # type: ignore[method-assign]
        with self.open(name) as store:
            if first + 1 in store.steps():
                self.expected[name][first + 1] = state

    @rule(
        how=st.sampled_from(
            ["no_age", "min_age", "member_unlistable", "pool_unlistable", "trash_unlistable"]
        )
    )
    def pool_gc(self, how: str) -> None:
        if how in ("no_age", "min_age"):
            for pool in (self.pool, self.pool2):
                collect_pool(pool, min_age_s=0.0 if how == "no_age" else 900.0)
            return
        before = self.pool_objects()
        target = {
            "member_unlistable": self.root / "m1" / "manifests",
            "trash_unlistable": Path(self.pool, "trash"),
        }.get(how)
        broken = str(target) if target is not None else str(Path(self.pool, "members"))
        if target is not None and not target.exists():
            return
        with unreadable_directories(broken):
            with pytest.raises((PoolMemberError, OSError)):
                collect_pool(self.pool, min_age_s=0.0)
        assert self.pool_objects() == before, "a refused pool gc moved or purged objects"

    def forget(self, name: str, visible: list[int]) -> None:
        self.expected[name] = {s: v for s, v in self.expected[name].items() if s in visible}

    # ------------------------------------------------------------------ invariant

    @invariant()
    def no_visible_step_loses_an_object(self) -> None:
        """Every object of every visible step is there; the newest restores exactly (a full
        load of every step after every rule costs more than the rest of the test)."""
        if not hasattr(self, "root"):
            return
        for name, steps in self.expected.items():
            with self.open(name) as store:
                visible = store.steps()
                assert set(visible) <= set(steps), f"{name}: unknown steps {visible}"
                for step in visible:
                    missing = [p for p in store.manifest(step).packs if not store.storage.exists(p)]
                    assert not missing, f"{name} step {step} lost {missing}"
                if visible:
                    assert_state_equal(store.load(visible[-1]), steps[visible[-1]])
                elif name in self.bases and (self.root / name / FORK_BASE).exists():
                    base = store.load_fork_base(keys="model")["model"]
                    assert_state_equal(base, self.bases[name]["model"])
                self.forget(name, visible)

    def teardown(self) -> None:
        """At the end every visible step restores its exact bytes."""
        try:
            if hasattr(self, "root"):
                for name, steps in self.expected.items():
                    with self.open(name) as store:
                        for step in store.steps():
                            assert_state_equal(store.load(step), steps[step])
        finally:
            self.remove()


QUICK = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_pool_state_machine() -> None:
    PoolMachine.TestCase.settings = QUICK
    PoolMachine.TestCase().runTest()


@pytest.mark.slow
def test_pool_state_machine_long() -> None:
    PoolMachine.TestCase.settings = settings(
        QUICK, max_examples=300 if DEEP else 60, stateful_step_count=40
    )
    PoolMachine.TestCase().runTest()
