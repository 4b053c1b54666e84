"""Background work yields to training: the store's threads (saving, encoding, writing) run at a
lower OS priority than the thread that trains, and its pools are sized to the cores training
leaves free."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core import workers as workers_module
from lightning_incremental.core.chunks import encode as encoder
from lightning_incremental.core.storage import open_storage
from lightning_incremental.core.workers import WorkerPool, free_cores, lower_priority
from tests.faulty import FaultyStorage

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class _Recording(FaultyStorage):
    """Records the priority and name of the thread of every ``put``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.seen: list[tuple[str, int]] = []

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        self.seen.append((threading.current_thread().name, _nice()))
        return super().put(path, data, overwrite=overwrite)


def _save_recorded(
    url: str, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """One save of tensors large enough for the workers; the (thread, priority) of every pack
    or manifest write and of every chunk encoded on a worker."""
    encoded: list[tuple[str, int]] = []
    original = encoder._encode_task

    def recorded(*args: Any) -> Any:
        encoded.append((threading.current_thread().name, _nice()))
        return original(*args)

    monkeypatch.setattr(encoder, "_encode_task", recorded)
    storage = _Recording(open_storage(url, None))
    state = {f"w{i}": torch.randn(64 * 1024) for i in range(4)}
    with CheckpointStore(storage, chunk_size=64 * 1024, pack_size=256 * 1024, **options) as store:
        store.save(state, 1).wait()
    background = ("li-save", "li-worker", "li-writer")  # not the lease's, not the caller's
    return [w for w in storage.seen if w[0].startswith(background)], encoded


@linux
def test_the_stores_threads_run_below_the_training_threads_priority(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _nice()
    writes, encoded = _save_recorded(local_url, monkeypatch)
    threads = {name.rsplit("_", 1)[0] for name, _ in writes + encoded}
    assert {"li-save", "li-worker", "li-writer"} <= threads, threads
    expected = min(19, main + workers_module.BACKGROUND_NICE)
    assert {nice for _, nice in writes + encoded} == {expected}, (writes, encoded)
    assert _nice() == main, "the training thread's priority changed"


@linux
def test_background_nice_0_keeps_the_training_threads_priority(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _nice()
    writes, encoded = _save_recorded(local_url, monkeypatch, background_nice=0, workers=2)
    assert {nice for _, nice in writes + encoded} == {main}


@linux
def test_a_pool_thread_lowers_only_its_own_priority() -> None:
    pool = WorkerPool(2, "li-test", nice=5, idle_s=0.1)
    main = _nice()
    try:
        inside = pool.submit(_nice).result()
    finally:
        pool.shutdown()
    assert inside == min(19, main + 5)
    assert _nice() == main
    # never raised back (that needs privileges), never past 19
    assert lower_priority(0) is False
    pool = WorkerPool(1, "li-test", nice=40, idle_s=0.1)
    try:
        assert pool.submit(_nice).result() == 19
    finally:
        pool.shutdown()


def test_pools_are_sized_to_the_cores_training_leaves_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert free_cores(2) == 4  # capped
    assert free_cores(6) == 2
    assert free_cores(8) == 1  # training takes every core: one encoding thread
    assert free_cores(16) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert free_cores() == 1


def test_an_automatic_store_starts_that_many_encoding_threads(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_incremental.core import engine

    monkeypatch.setattr(engine, "free_cores", lambda: 3)
    with CheckpointStore(local_url) as store:
        assert store.config.workers is None  # automatic, as configured
        assert store._engine.pool.max_workers == 3
        assert store._engine.writer is not store._engine.pool
    with CheckpointStore(local_url + "-one", workers=1) as store:
        assert store._engine.writer is store._engine.pool  # one thread does all, in order


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("background_nice", -1, "must be >= 0"),
        ("background_nice", 20, "0..19"),
        ("background_nice", 1.5, "must be an int"),
        ("workers", 0, "must be >= 1"),
    ],
)
def test_bad_background_settings_are_refused(
    local_url: str, option: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointStore(local_url, **{option: value})


def test_a_restore_decodes_on_every_core_at_the_callers_priority(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore is not background work (its caller waits, as for ``torch.load``): its decodes
    run on one thread per core the process may use, at the caller's priority, not on the
    save's pool (sized to the cores training leaves free: one of two)."""
    import time

    from lightning_incremental.core.load import pipeline

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    state = {f"w{i}": torch.randn(64 * 1024) for i in range(8)}
    with CheckpointStore(local_url, chunk_size=64 * 1024) as store:
        store.save(state, 1).wait()
    seen: list[tuple[str, int]] = []
    original = pipeline.decode_chunk

    def recorded(*args: Any) -> Any:
        seen.append((threading.current_thread().name, _nice()))
        time.sleep(0.02)  # long enough that every thread gets a chunk
        return original(*args)

    monkeypatch.setattr(pipeline, "decode_chunk", recorded)
    with CheckpointStore(local_url) as store:
        loaded = store.load(1)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    threads = {name for name, _ in seen}
    assert len(threads) == 2 and all(n.startswith("li-reader") for n in threads), seen
    if sys.platform.startswith("linux"):
        assert {nice for _, nice in seen} == {_nice()}, seen


def test_restore_pools_are_sized_to_the_cores(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_incremental.core import engine
    from lightning_incremental.core.workers import restore_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert restore_cores() == workers_module.MAX_RESTORE_WORKERS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert restore_cores() == 1
    monkeypatch.setattr(engine, "restore_cores", lambda: 5)
    with CheckpointStore(str(tmp_path / "auto")) as store:
        assert store._engine.reader.max_workers == 5
    with CheckpointStore(str(tmp_path / "one"), workers=1) as store:
        assert store._engine.reader.max_workers == 1  # an explicit setting bounds restores too
