"""Fault injection at every phase of a save.

A save writes its data objects (packs), then its manifest last. Whatever phase fails:

(a) the error reaches the caller — through ``handle.wait()``, or, when nobody waited, through the
    next ``save`` or ``close`` — exactly once, as the very exception the storage raised;
(b) a fresh store on the same location sees either the previous checkpoint or the new one, never
    a mix, and restores it bit-identically;
(c) once the fault is cleared the same store commits newer steps, and ``gc`` removes exactly what
    the failed save left unreferenced.

Everything is ordered deterministically: faults fire on the Nth matching call, background saves
are ordered with events, nothing sleeps.
"""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import pytest
import torch

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    SaveHandle,
    StepError,
    StorageError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.layout import manifest_path
from lightning_incremental.core.storage import Storage, open_storage
from tests.conftest import assert_state_equal, small_store
from tests.faulty import FaultyStorage

WAIT_S = 60.0  # bound on waiting for a background save; never reached unless the engine hangs


def state(step: int) -> dict[str, Any]:
    """A small training state: ~56 KiB of tensors (several 16 KiB pack objects per save with
    4 KiB chunks), a frozen tensor that later saves reuse, and plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "a": torch.randn(4096, generator=g),
            "b": torch.randn(64, 64, generator=g),
            "c": torch.randn(32, 64, generator=g, dtype=torch.float64),
            "frozen": torch.arange(2048, dtype=torch.float32),
        },
        "optimizer": {"lr": 0.1 / step, "betas": (0.9, 0.999)},
        "step": step,
    }


def _store(faulty: FaultyStorage, **options: Any) -> CheckpointStore:
    """``small_store`` over a storage instance."""
    options.setdefault("min_object_age_s", 0)  # these stores have one writer: sweep at once
    return CheckpointStore(faulty, chunk_size=4096, pack_size=16384, **options)


def _finished(handle: SaveHandle) -> None:
    """Wait until a background save ended, without consuming its error (SaveHandle has no
    public method for that: ``wait`` delivers the error)."""
    assert handle._done.wait(WAIT_S), f"save of step {handle.step} did not finish"


def _live_packs(storage: Storage) -> set[str]:
    """Every pack object some committed manifest names."""
    live: set[str] = set()
    for path in storage.list(mf.MANIFEST_DIR):
        step = mf.step_of(path.rsplit("/", 1)[-1])
        if step is not None:
            live.update(canonical.loads(storage.get(path), path).packs)
    return live


def _assert_visible(url: str, steps: list[int]) -> None:
    """A fresh store on ``url`` sees exactly ``steps`` and restores each bit-identically."""
    with small_store(url) as fresh:
        assert fresh.steps() == steps
        assert_state_equal(fresh.load(), state(steps[-1]))
        for step in steps:
            assert_state_equal(fresh.load(step), state(step))
            report = fresh.verify(step)
            assert report.ok, (step, report)


@pytest.fixture(scope="module")
def packs_per_save() -> int:
    """How many pack objects the second save of the scenario writes (probe without faults)."""
    faulty = FaultyStorage(open_storage("memory://li-test-faults-probe", None))
    try:
        with _store(faulty) as store:
            store.save(state(1), 1).wait()
            before = faulty.count("put", "pack")
            store.save(state(2), 2).wait()
            count = faulty.count("put", "pack") - before
    finally:
        for path in faulty.inner.list(""):
            faulty.inner.delete(path)
    assert count >= 3, "the scenario must write several packs per save"
    return count


# phase id -> (fault arguments, does the checkpoint commit?)
PHASES: dict[str, tuple[dict[str, Any], bool]] = {
    "before-any-data": ({"phase": "pack", "nth": 1}, False),
    "between-data": ({"phase": "pack", "nth": 2}, False),
    "last-data": ({"phase": "pack", "nth": -1}, False),  # nth resolved to the last pack
    "data-landed-then-error": ({"phase": "pack", "nth": 2, "when": "after"}, False),
    "after-data-before-manifest": ({"phase": "manifest"}, False),
}


def _deliver(store: CheckpointStore, handle: SaveHandle, how: str) -> BaseException:
    """Make the failed save's error surface the way ``how`` says; return it."""
    if how == "wait":
        with pytest.raises(OSError) as raised:
            handle.wait(WAIT_S)
        assert store.wait() == [], "wait() delivered the error again or reported a result"
    elif how == "next-save":
        _finished(handle)
        with pytest.raises(OSError) as raised:
            store.save(state(3), 3)
        assert store.wait() == []
        with pytest.raises(OSError) as again:  # the handle itself still tells what happened
            handle.wait(WAIT_S)
        assert again.value is raised.value
    else:
        assert how == "close"
        with pytest.raises(OSError) as raised:
            store.close()
        store.close()  # idempotent: the error was delivered once
        with pytest.raises(OSError) as again:
            handle.wait(WAIT_S)
        assert again.value is raised.value
    return raised.value


@pytest.mark.parametrize("how", ["wait", "next-save", "close"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_fault_at_each_phase_of_a_save(
    store_url: str, phase: str, how: str, packs_per_save: int
) -> None:
    faulty = FaultyStorage(open_storage(store_url, None))
    store = _store(faulty)
    try:
        store.save(state(1), 1).wait()
        args, commits = PHASES[phase]
        args = dict(args)
        if args.get("nth") == -1:
            args["nth"] = packs_per_save
        fault = faulty.fail(**args)
        handle = store.save(state(2), 2)
        error = _deliver(store, handle, how)

        # (a) the very error the storage raised, once, naming what failed
        assert faulty.raised == [error]
        assert isinstance(error, StorageError) and error.errno == errno.EIO
        assert fault.seen >= fault.nth
        if fault.phase == "pack":
            assert faulty.count("put", "manifest") == 1, "a manifest was written after a failure"

        # (b) the previous checkpoint or the new one, complete, never a mix
        visible = [1, 2] if commits else [1]
        assert faulty.inner.list("manifests") == [manifest_path(s) for s in visible]
        _assert_visible(store_url, visible)

        # (c) usable again once the fault is cleared
        faulty.clear()
        if how == "close":
            store = _store(faulty)
        result = store.save(state(3), 3).wait(WAIT_S)
        assert result.step == 3
        _assert_visible(store_url, [*visible, 3])

        live = _live_packs(faulty.inner)
        orphans = set(faulty.inner.list("packs")) - live
        if phase in ("data-landed-then-error", "after-data-before-manifest"):
            assert orphans, "the failed save's landed objects should be unreferenced"
        report = store.gc()
        assert set(report.removed_objects) == orphans
        assert set(faulty.inner.list("packs")) == live
        _assert_visible(store_url, [*visible, 3])
    finally:
        faulty.clear()
        store.close()


def test_a_manifest_that_landed_although_its_write_failed_is_committed(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The manifest landed, then the client saw an error (a lost response; its retries ran out):
    the store reads it back, finds its own bytes, and the save commits, with a warning."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        faulty.fail("manifest", when="after")
        result = store.save(state(2), 2).wait(WAIT_S)
        assert result.step == 2 and len(faulty.raised) == 1
        assert "landed although its write reported an error" in caplog.text
        faulty.clear()
        assert store.save(state(3), 3).wait(WAIT_S).step == 3
    _assert_visible(store_url, [1, 2, 3])


def test_a_manifest_write_whose_outcome_is_unknown_says_so(store_url: str) -> None:
    """The write failed and reading it back fails too: the error says the step may be
    committed, and saving the same state at the same step again is safe (idempotent)."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        faulty.fail("manifest", when="after")
        faulty.fail("manifest", op="get")
        with pytest.raises(StorageError, match="step 2 may or may not be committed") as raised:
            store.save(state(2), 2).wait(WAIT_S)
        assert "list the store's steps" in str(raised.value)
        faulty.clear()
        result = store.save(state(2), 2).wait(WAIT_S)  # the retry finds the committed one
        assert result.step == 2
        with pytest.raises(StepError):  # another state at a committed step is still refused
            store.save(state(9), 2).wait(WAIT_S)
    _assert_visible(store_url, [1, 2])


def test_failed_step_can_be_saved_again(store_url: str) -> None:
    """A save that never committed does not use up its step number."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        faulty.fail("manifest")
        with pytest.raises(StorageError):
            store.save(state(2), 2).wait(WAIT_S)
        faulty.clear()
        assert store.save(state(2), 2).wait(WAIT_S).step == 2
    _assert_visible(store_url, [1, 2])


def test_first_save_fails_writing_the_store_marker(store_url: str) -> None:
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        faulty.fail("marker")
        with pytest.raises(StorageError) as raised:
            store.save(state(1), 1).wait(WAIT_S)
        assert faulty.raised == [raised.value]
        assert faulty.count("put", "pack") == 0 and faulty.count("put", "manifest") == 0
        with small_store(store_url) as fresh:
            assert fresh.steps() == []
            with pytest.raises(CheckpointNotFoundError):
                fresh.load()
        faulty.clear()
        store.save(state(1), 1).wait(WAIT_S)
    _assert_visible(store_url, [1])


def test_error_of_a_failed_save_is_not_lost_behind_a_later_one(store_url: str) -> None:
    """Save 2 fails while save 3 is already queued: save 3 still commits (on top of step 1,
    the newest committed), and save 2's error is raised by ``wait`` — once."""
    faulty = FaultyStorage(open_storage(store_url, None))
    store = _store(faulty, max_in_flight=2)
    try:
        store.save(state(1), 1).wait()
        gate = faulty.hold("pack")
        faulty.fail("pack", nth=1)
        failing = store.save(state(2), 2)
        queued = store.save(state(3), 3)  # save 2 cannot have finished: its writes are held
        assert not failing.done()
        gate.set()
        with pytest.raises(StorageError) as raised:
            store.wait()
        assert faulty.raised == [raised.value]
        assert queued.wait(WAIT_S).step == 3
        assert store.wait() == [queued.wait()]
        with pytest.raises(StorageError) as again:
            failing.wait(WAIT_S)
        assert again.value is raised.value
    finally:
        faulty.clear()
        store.close()
    _assert_visible(store_url, [1, 3])


def test_torn_manifest_is_never_loaded(store_url: str) -> None:
    """A backend that breaks atomicity leaves half a manifest under the final name: it is seen
    as a committed step, but restore rejects it and falls back, and the history goes on."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        faulty.fail("manifest", when="torn")
        with pytest.raises(StorageError):
            store.save(state(2), 2).wait(WAIT_S)
        assert faulty.landed == [manifest_path(2)]

    with small_store(store_url) as fresh:
        assert fresh.steps() == [1, 2]
        with pytest.raises(ManifestError, match="step 2"):
            fresh.load(2)
        with pytest.raises(CorruptCheckpointError):
            fresh.load(strict=True)
        assert not fresh.verify(2).ok
        with pytest.warns(UserWarning, match="step 2"):
            restored = fresh.load()
        assert_state_equal(restored, state(1))
        # the job resumed from step 1 redoes step 2: the torn record moves out of the way
        fresh.save(state(2), 2).wait(WAIT_S)
        assert fresh.storage.exists("quarantine/00000000000000000002.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_visible(store_url, [1, 2])


def test_read_error_during_load_is_raised_not_fallen_back(store_url: str) -> None:
    """An I/O error is not corruption: load raises it instead of quietly restoring an older
    checkpoint (and without writing the newest one off)."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        store.save(state(2), 2).wait()
    with _store(faulty) as store:
        faulty.fail("pack", op="get", times=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(StorageError):
                store.load()
        faulty.clear()
        assert_state_equal(store.load(), state(2))
        store.save(state(3), 3).wait(WAIT_S)
    _assert_visible(store_url, [1, 2, 3])


# ---------------------------------------------------------------------------- disk full


@pytest.mark.parametrize("translate", [True, False], ids=["storage-error", "bare-oserror"])
@pytest.mark.parametrize("phase", ["pack", "manifest"])
def test_disk_full(store_url: str, phase: str, translate: bool) -> None:
    """ENOSPC that lasts: every save fails clearly, step 1 stays intact, and saving works again
    once space is freed. ``bare-oserror`` is a third-party Storage that does not translate."""
    faulty = FaultyStorage(open_storage(store_url, None))
    with _store(faulty) as store:
        store.save(state(1), 1).wait()
        faulty.fail(phase, errno=errno.ENOSPC, times=None, translate=translate)
        for step in (2, 3):
            with pytest.raises(OSError) as raised:
                store.save(state(step), step).wait(WAIT_S)
            error = raised.value
            assert error.errno == errno.ENOSPC
            # concurrent pack writes may each fail; the store surfaces one of them, unchanged
            assert any(error is e for e in faulty.raised)
            if translate:
                assert isinstance(error, StorageError)
                assert "disk full" in str(error)
            else:
                assert os.strerror(errno.ENOSPC) in str(error)
        _assert_visible(store_url, [1])
        faulty.clear()
        store.save(state(2), 2).wait(WAIT_S)
    _assert_visible(store_url, [1, 2])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("directory", ["packs", "manifests"])
def test_disk_full_on_a_real_local_disk(
    local_url: str, monkeypatch: pytest.MonkeyPatch, directory: str
) -> None:
    """The engine's own local backend hits ENOSPC (its fsync fails): a StorageError that says
    disk full, no temporary file left behind, step 1 intact, and it works again afterwards."""
    with small_store(local_url) as store:
        store.save(state(1), 1).wait()
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if f"{os.sep}{directory}{os.sep}" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(StorageError) as raised:
            store.save(state(2), 2).wait(WAIT_S)
        monkeypatch.undo()
        assert raised.value.errno == errno.ENOSPC
        assert "disk full" in str(raised.value)
        leftovers = [
            name for _, _, files in os.walk(local_url) for name in files if name.startswith(".tmp-")
        ]
        assert leftovers == []
        _assert_visible(local_url, [1])
        store.save(state(2), 2).wait(WAIT_S)
    _assert_visible(local_url, [1, 2])
