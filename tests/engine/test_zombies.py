"""Zombies and races: a writer that lost its lease, or that a newer generation took over from,
commits nothing visible and deletes nothing; no sweep removes an object a save in flight may
name.

Real processes are frozen with SIGSTOP at a chosen point (the way ``scontrol suspend`` or a
stalled host freezes a job) and woken with SIGCONT after another writer moved on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError, FencedError
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.commit import lease as lease_mod
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.sweep import CLOCK_DIR
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal, small_store
from tests.engine.test_fencing import _all_threads_stopped, _waiting_on
from tests.faulty import FaultyStorage

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2048,), value), "b": torch.arange(8) * value}


def _start_frozen(script: str, url: str) -> subprocess.Popen[str]:
    """Run ``script`` in a new process and return once it stopped itself (SIGSTOP)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _all_threads_stopped(proc.pid):
        if proc.poll() is not None:
            raise AssertionError(f"the writer ended before freezing:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, "the writer never froze"
        time.sleep(0.05)
    return proc


def _wake(proc: subprocess.Popen[str]) -> tuple[int, str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


# A single-process writer (it never claims a generation) frozen between its lease check and
# its manifest write, holding a short lease.
FROZEN_HOLDER = """
    import os, signal, sys, time, torch
    from lightning_incremental.core import CheckpointStore, FencedError

    store = CheckpointStore(sys.argv[1], chunk_size=4096, pack_size=16384, lease_ttl_s=1.0)
    store.save({"w": torch.full((2048,), 10.0), "b": torch.arange(8) * 10.0}, 10).wait()
    put = store.storage.put

    def freeze_before_manifest(path, data, **kw):
        if path.startswith("manifests/"):
            os.kill(os.getpid(), signal.SIGSTOP)  # after the lease check, before the commit
            time.sleep(0.5)  # the sending thread may run on for a moment: it stops in here
        return put(path, data, **kw)

    store.storage.put = freeze_before_manifest
    try:
        store.save({"w": torch.full((2048,), 20.0), "b": torch.zeros(8)}, 20).wait()
    except FencedError as exc:
        print("FENCED", exc, flush=True)
        sys.exit(3)
    print("COMMITTED", flush=True)
"""


def test_a_frozen_lease_holder_commits_nothing_visible_after_a_takeover(local_url: str) -> None:
    """The lease expires while its holder is frozen; the next writer takes it over and, because
    the holder never released it, claims a new generation before its first commit. The holder
    wakes and writes its manifest: it lands, is never visible, and its save raises."""
    holder = _start_frozen(FROZEN_HOLDER, local_url)
    try:
        with small_store(local_url, lease_ttl_s=1.0) as new:
            assert new.load()["w"][0] == 10.0 and new.steps() == [10]
            record = lease_mod.newest(new.storage)
            assert record is not None and record.doc["pid"] == holder.pid
            while time.time() - record.doc["heartbeat"] <= 1.5:  # the holder's lease expires
                time.sleep(0.1)
            new.save(state(15.0), 15).wait()
            code, out = _wake(holder)
            assert code == 3, out
            assert "FENCED checkpoint step 20 committed after it was fenced off" in out
            assert new.generation == 1, "the takeover claimed a new generation"
            assert new.storage.exists(mf.manifest_path(20)), "it landed ..."
            assert new.steps() == [10, 15], "... and is not visible"
            assert_state_equal(new.load(), state(15.0))
        with small_store(local_url) as reader:
            assert reader.steps() == [10, 15]
            assert_state_equal(reader.load(), state(15.0))
    finally:
        _kill(holder)


# A restarted job's previous incarnation (same run id, generation 1, keep_last=1) frozen in
# its retention after committing step 2: it planned what to keep, and stops at the sweep's
# first orphan (the size it reads right before the deletion guard and the deletion).
FROZEN_RETENTION = """
    import os, signal, sys, time, torch
    from lightning_incremental.core import CheckpointStore

    store = CheckpointStore(
        sys.argv[1], chunk_size=4096, pack_size=16384, keep_last=1, min_object_age_s=0
    )
    store.claim_generation()
    store.save({"w": torch.full((2048,), 1.0), "b": torch.arange(8) * 1.0}, 1).wait()
    put, size, armed = store.storage.put, store.storage.size, []

    def arm_after_commit(path, data, **kw):
        done = put(path, data, **kw)
        if path.startswith("manifests/"):
            armed.append(True)
        return done

    def freeze_at_sweep(path):
        if armed and path.startswith("packs/"):
            armed.clear()
            os.kill(os.getpid(), signal.SIGSTOP)  # its first orphan: the deletion comes next
            time.sleep(0.5)  # the sending thread may run on for a moment: it stops in here
        return size(path)

    store.storage.put, store.storage.size = arm_after_commit, freeze_at_sweep
    result = store.save({"w": torch.full((2048,), 2.0), "b": torch.arange(8) * 2.0}, 2).wait()
    print("COMMITTED", result.step, "WARNINGS", *result.warnings, flush=True)
"""


def test_a_fenced_zombie_deletes_nothing(local_url: str, monkeypatch) -> None:
    """The restarted job (same run id) claims generation 2 over the frozen one, resumes from
    step 2 and saves step 3; the zombie wakes mid-retention and must delete nothing (with no
    minimum object age to help it): every object of step 3 stays."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-retention")
    zombie = _start_frozen(FROZEN_RETENTION, local_url)
    try:
        with small_store(local_url) as new:
            assert new.claim_generation(1) == 2
            assert_state_equal(new.load(), state(2.0))
            new.save(state(3.0), 3).wait()
            before = set(new.storage.list("packs"))
            code, out = _wake(zombie)
            assert code == 0, out
            assert "COMMITTED 2" in out, out
            assert "retention after step 2 failed, nothing was deleted past the failure" in out
            assert "lost the writer lease" in out, out
            assert set(new.storage.list("packs")) == before, "the zombie deleted objects"
            assert new.verify(3).ok
            assert new.steps() == [2, 3]
            assert_state_equal(new.load(), state(3.0))
    finally:
        _kill(zombie)


# ------------------------------------------------------------------ minimum object age


def _orphan(store: CheckpointStore, age_s: float = 0.0) -> str:
    """An unreferenced pack object, as a save in flight leaves it, ``age_s`` old."""
    data = np.random.default_rng().bytes(512)
    path = mf.pack_path(chunk_hash(data))
    store.storage.put(path, data)
    if age_s:
        full = Path(store.url, *path.split("/"))
        stamp = time.time() - age_s
        os.utime(full, (stamp, stamp))
    return path


def test_no_sweep_removes_an_object_younger_than_the_minimum_age(local_url: str) -> None:
    with small_store(local_url, keep_last=1) as store:
        assert store.config.min_object_age_s == 900.0
        store.save(state(1.0), 1).wait()
        young, old = _orphan(store), _orphan(store, age_s=1000)
        report = store.gc()  # no grace period: the minimum age still holds
        assert report.removed_objects == [old]
        assert store.storage.exists(young)
        # retention after a commit spares the young objects of the removed checkpoint
        first = set(store.storage.list("packs"))
        store.save(state(2.0), 2).wait()
        assert store.steps() == [2]
        assert first <= set(store.storage.list("packs"))
        assert store.verify(2).ok


def test_an_orphan_written_again_while_the_sweep_reaches_it_stays(local_url: str) -> None:
    """A save writes again, with the same bytes, an old orphan the sweep is about to delete
    (its writer rewrites an existing pack: a fresh object). The sweep reads the object's age
    right before deleting it, after everything else: the rewritten object is young and stays."""

    class RewritesAtTheSweep(LocalStorage):
        target: str | None = None

        def size(self, path: str) -> int:
            if path == self.target:  # the sweep looks at the orphan ...
                self.target = None
                data = self.get(path)
                self.put(path, data, overwrite=True)  # ... as a save writes it again
            return super().size(path)

    storage = RewritesAtTheSweep(local_url)
    with small_store(storage) as store:
        store.save(state(1.0), 1).wait()
        orphan = _orphan(store, age_s=2 * HOUR)
        storage.target = orphan
        report = store.gc()
        assert storage.target is None, "the sweep never looked at the orphan"
        assert orphan not in report.removed_objects
        assert store.storage.exists(orphan)


def test_the_minimum_age_is_validated() -> None:
    for bad in (-1, float("nan"), "900", True):
        with pytest.raises(ConfigError, match="min_object_age_s"):
            CheckpointStore("memory://min-age-validated", min_object_age_s=bad)


class SkewedStorage(LocalStorage):
    """A storage whose own clock runs an hour behind this host's (an object store's
    ``LastModified`` is the server's time)."""

    def mtime(self, path: str) -> float | None:
        stamp = super().mtime(path)
        return None if stamp is None else stamp - HOUR


def test_ages_are_read_by_the_storage_clock(local_url: str) -> None:
    """By this host's clock every object of the skewed storage looks an hour old; by the
    storage's own clock the young one is young and the old one old."""
    with small_store(SkewedStorage(local_url)) as store:
        store.save(state(1.0), 1).wait()
        young, old = _orphan(store), _orphan(store, age_s=2 * HOUR)
        report = store.gc(grace_s=600)
        assert report.removed_objects == [old]
        assert store.storage.exists(young)
        assert store.storage.list(CLOCK_DIR) == [], "the clock object is gone"


def test_a_lease_less_gc_is_not_fenced_but_a_writers_is(local_url: str) -> None:
    """A maintenance gc with a grace period holds no lease and is not judged by generations;
    a writer behind the newest fence deletes nothing."""
    with small_store(local_url, min_object_age_s=0) as writer:
        writer.save(state(1.0), 1).wait()
        writer.save(state(2.0), 2).wait()
        with small_store(local_url) as other:  # shares this process's lease
            assert other.claim_generation(5) == 5
        with pytest.raises(FencedError, match="deletes nothing"):
            writer.gc(keep_last=1)
        assert writer.steps() == [1, 2]
    with small_store(local_url) as maintenance:
        assert maintenance.gc(keep_last=1, grace_s=1).removed_steps == [1]


def test_a_save_after_an_object_went_missing_encodes_its_chunks_again(local_url: str) -> None:
    """An object the newest checkpoint names is gone (lost, or removed by hand): a new
    writer's save, which would reuse it, encodes its chunks again from the state instead of
    failing with a message about another process deleting objects."""
    with small_store(local_url) as store:
        store.save(state(1.0), 1).wait()
        doc = store.manifest(1)
    frozen = next(t for t in doc.tensors if t.path == "state['w']")
    lost = doc.chunks[frozen.chunks[0]].pack
    LocalStorage(local_url).delete(lost)
    with small_store(local_url) as store:
        store.save(state(1.0), 2).wait()  # the same values: every chunk would be reused
        assert store.verify(2).ok
        assert_state_equal(store.load(2), state(1.0))


def test_the_minimum_age_holds_on_every_backend(store_url: str) -> None:
    """The storage clock works on each backend (S3's server time included): a young orphan
    survives a gc without grace; with the minimum age off, the same gc removes it; the clock's
    marker object is gone afterwards."""
    with small_store(store_url) as store:
        store.save(state(1.0), 1).wait()
        young = _orphan(store)
        assert store.gc().removed_objects == []
        assert store.storage.exists(young)
        assert store.storage.list(CLOCK_DIR) == []
    with small_store(store_url, min_object_age_s=0) as store:
        assert store.gc().removed_objects == [young]


class UndatedStorage(LocalStorage):
    """A backend that cannot tell when an object was written."""

    def mtime(self, path: str) -> float | None:
        return None


def test_a_backend_without_modification_times_keeps_objects_and_says_so(
    local_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with small_store(UndatedStorage(local_url)) as store:
        store.save(state(1.0), 1).wait()
        orphan = _orphan(store)
        assert store.gc().removed_objects == []
        assert store.storage.exists(orphan)
        assert "gives no modification times: 1 unreferenced object(s) were kept" in caplog.text
    with small_store(UndatedStorage(local_url), min_object_age_s=0) as store:
        assert store.gc().removed_objects == [orphan]


def test_a_clock_marker_left_by_a_crash_is_swept_later(local_url: str) -> None:
    """A process that died between writing the clock's marker and removing it leaves it
    behind: a later sweep removes it once it is an hour old, like any temporary file."""
    with small_store(local_url, min_object_age_s=0) as store:
        store.save(state(1.0), 1).wait()
        store.storage.put(f"{CLOCK_DIR}/left-by-a-crash", b"")
        store.storage.put(f"{CLOCK_DIR}/written-just-now", b"")
        stamp = time.time() - 2 * HOUR
        os.utime(Path(local_url, CLOCK_DIR, "left-by-a-crash"), (stamp, stamp))
        store.gc()
        assert store.storage.list(CLOCK_DIR) == [f"{CLOCK_DIR}/written-just-now"]


def test_a_writer_frozen_before_its_first_lease_record_is_fenced_off_by_the_first_claim(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer of the job's previous incarnation stops in its very first save, before its
    lease record lands (nothing was claimed yet: it joined generation 0). The restarted job
    claims the store and finishes (it releases the lease). The old writer wakes: it takes the
    released lease, but the first claim was above the generation it joined, so what it commits
    is not visible and it is told so."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-first")
    root = local_url

    class FreezesAtItsLease(LocalStorage):
        """The old process's storage (a location key of its own: its own lease)."""

        frozen = False

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.url = f"{path} (old process)"

        def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
            if path.startswith("lease/") and not self.frozen:
                self.frozen = True  # meanwhile, the restarted job runs and ends
                with small_store(root) as restarted:
                    restarted.claim_generation()
            return super().put(path, data, overwrite=overwrite)

    old = CheckpointStore(FreezesAtItsLease(root), chunk_size=4096, pack_size=16384)
    try:
        with pytest.raises(FencedError, match="step 1 not committed"):
            old.save(state(1.0), 1).wait()
    finally:
        old.close()
    with small_store(root) as reader:
        assert reader.steps() == []


# ------------------------------------------------------------------ compaction


# A single-process writer (short lease) that saved steps 1 and 2 (a delta) and compacts step 2:
# frozen between its checks and the write of the compacted manifest, for longer than its
# lease and than the minimum object age of the writer that takes over.
FROZEN_COMPACTION = """
    import os, signal, sys, time, torch
    from lightning_incremental.core import CheckpointStore, FencedError, WriterLeaseError

    store = CheckpointStore(
        sys.argv[1], chunk_size=4096, pack_size=16384, lease_ttl_s=1.0, full_every=100
    )
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g)
    store.save({"w": w, "b": torch.arange(8) * 1.0}, 1).wait()
    w = w + 1e-3 * torch.randn(4096, generator=g)
    store.save({"w": w, "b": torch.arange(8) * 2.0}, 2).wait()
    torch.save(w, sys.argv[2])
    put = store.storage.put

    def freeze_before_manifest(path, data, **kw):
        if path.startswith("manifests/"):
            os.kill(os.getpid(), signal.SIGSTOP)  # after its checks, before the write
            time.sleep(0.5)  # the sending thread may run on for a moment: it stops in here
        return put(path, data, **kw)

    store.storage.put = freeze_before_manifest
    try:
        store.compact()
    except (FencedError, WriterLeaseError) as exc:
        print("FENCED", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("COMPACTED", flush=True)
"""


def _age_everything(root: str, seconds: float) -> None:
    """Every file of the store ``seconds`` older (a freeze that lasted that long)."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            stat = os.stat(path)
            os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))


def test_a_frozen_compaction_makes_nothing_visible_after_a_takeover(
    local_url: str, tmp_path: Path
) -> None:
    """The compactor wrote the full base's objects and stops before its manifest; the next
    writer takes over (claiming a new generation) and collects with keep_last=1, which sweeps
    the compactor's unreferenced new objects (older than the minimum age: a long freeze). The
    compactor wakes and writes its manifest: it is not visible, it is told so, and step 2
    restores as committed."""
    saved = tmp_path / "w.pt"
    compactor = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FROZEN_COMPACTION), local_url, str(saved)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _all_threads_stopped(compactor.pid):
            assert compactor.poll() is None, compactor.stdout.read()
            assert time.monotonic() < deadline, "the compactor never froze"
            time.sleep(0.05)
        record = lease_mod.newest(LocalStorage(local_url))
        assert record is not None and record.doc["pid"] == compactor.pid
        while time.time() - record.doc["heartbeat"] <= 1.5:  # the compactor's lease expires
            time.sleep(0.1)
        _age_everything(local_url, 2 * HOUR)  # the freeze lasted past the minimum age too
        with small_store(local_url, lease_ttl_s=1.0) as new:
            report = new.gc(keep_last=1)  # takes the lease over, claims, collects
            assert new.generation == 1
            assert report.removed_objects, "the compactor's new objects were swept"
            code, out = _wake(compactor)
            assert code == 3, out
            assert "FENCED FencedError compaction of checkpoint step 2" in out, out
            assert new.steps() == [2]
            assert new.verify(2).ok
            expected = torch.load(saved)
            assert torch.equal(new.load(2)["w"], expected)
            assert new.storage.exists(mf.manifest_path(2, 0)), "it landed ..."
            new.gc(keep_last=1)  # ... and goes, not visible; the step stays as committed
            assert new.steps() == [2]
            assert new.storage.list(mf.MANIFEST_DIR) == [mf.manifest_path(2)]
        with small_store(local_url) as reader:
            assert torch.equal(reader.load()["w"], expected)
    finally:
        _kill(compactor)


# ------------------------------------------------------------------ one process, two stores


def test_maintenance_through_a_second_store_object_waits_for_the_save_in_flight(
    local_url: str,
) -> None:
    """Two store objects on one location in one process (training, and a maintenance store
    beside it) are one writer: a compact + gc(keep_last=1) through the second waits for the
    first's save, which is held after it checked the objects it reuses and before its manifest
    (where, without the exclusion, the delta objects it reuses were deleted under it)."""
    faulty = FaultyStorage(LocalStorage(local_url))
    trainer = small_store(faulty, full_every=100, min_object_age_s=0)
    maintenance = small_store(local_url, min_object_age_s=0)  # the same location, unheld
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4096, generator=g)
        for step in (1, 2):
            w = w + 1e-3 * torch.randn(4096, generator=g)
            trainer.save({"w": w, "frozen": torch.arange(4096.0)}, step).wait()
        gate = faulty.hold("manifest", op="put")
        last = {"w": w + 1e-3 * torch.randn(4096, generator=g), "frozen": torch.arange(4096.0)}
        handle = trainer.save(last, 3)
        while not _waiting_on(gate):  # step 3 wrote its part and is about to commit
            time.sleep(0.01)
        done: list[object] = []
        thread = threading.Thread(
            target=lambda: done.append((maintenance.compact(), maintenance.gc(keep_last=1)))
        )
        thread.start()
        thread.join(3.0)
        assert not done and thread.is_alive(), "maintenance ran beside the save in flight"
        gate.set()
        handle.wait()
        thread.join(60)
        assert done, "the maintenance never ran"
        assert maintenance.steps() == [3]
        report = maintenance.verify(3)
        assert report.ok, report.errors
        assert_state_equal(maintenance.load(3), last)
    finally:
        faulty.clear()
        trainer.close()
        maintenance.close()


# ------------------------------------------------------------------ a long sweep


def test_a_sweep_longer_than_its_grace_spares_a_checkpoint_committed_meanwhile(
    local_url: str,
) -> None:
    """A gc without the lease (grace period 0.5 s, no minimum age) fixes its live set; a save
    commits step 3 right after; the sweep then takes longer than the grace period (held at its
    first object). Ages are judged against the plan's time: step 3's objects were younger than
    the grace period then, however long the sweep runs, and stay."""
    writer = small_store(local_url, min_object_age_s=0)
    faulty = FaultyStorage(LocalStorage(local_url))
    faulty.url = f"{local_url} (another process)"  # its own lock: not this process's writer
    try:
        for step in (1, 2):
            writer.save(state(float(step)), step).wait()
        planned = faulty.hold("manifest", op="get")  # gc listed, reads what it keeps
        swept = faulty.hold("pack", op="mtime")  # the sweep reaches its first object
        reports = []
        with small_store(faulty, min_object_age_s=0) as collector:
            thread = threading.Thread(
                target=lambda: reports.append(collector.gc(keep_last=1, grace_s=0.5))
            )
            thread.start()
            while not _waiting_on(planned):
                time.sleep(0.01)
            writer.save(state(3.0), 3).wait()
            newest = set(writer.manifest(3).packs)
            planned.set()
            while not _waiting_on(swept):
                time.sleep(0.01)
            time.sleep(1.5)  # the sweep has run longer than the grace period
            swept.set()
            thread.join(60)
        (report,) = reports
        assert report.removed_steps == [1]
        assert not newest & set(report.removed_objects), "step 3 lost objects"
        assert writer.verify(3).ok
        assert_state_equal(writer.load(3), state(3.0))
    finally:
        faulty.clear()
        writer.close()
