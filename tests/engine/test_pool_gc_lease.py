"""One collection of a pool at a time: a second collection (in this process or another) is
refused while the first holds the pool's lease, deleting nothing; a collection frozen longer
than the lease's TTL is taken over, and when it wakes it stops at its next check instead of
purging or moving beside the newer one. Every member's committed step stays loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.maintain import pool_gc
from lightning_incremental.core.maintain.pool_gc import PoolGcBusyError, collect_pool
from tests.conftest import assert_state_equal
from tests.engine.test_pool_trash import OPTIONS, age, files, garbage, state

REPO = Path(__file__).resolve().parents[2]


def member(tmp_path: Path, pool: str) -> dict[str, Any]:
    """A member that keeps a committed step in the pool; returns what it saved."""
    saved = state(99)
    with CheckpointStore(tmp_path / "kept", pool=pool, **OPTIONS) as store:
        store.save(saved, 1).wait()
    return saved


def check_member(tmp_path: Path, saved: dict[str, Any]) -> None:
    with CheckpointStore(tmp_path / "kept") as store:
        assert_state_equal(store.load(1), saved)
        assert store.verify(1).ok


def test_a_second_collection_in_this_process_is_refused(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    saved = member(tmp_path, pool)
    unreferenced = garbage(tmp_path, pool, 1) | garbage(tmp_path, pool, 2)
    age(tmp_path / "pool")
    entered, go = threading.Event(), threading.Event()
    real = pool_gc._Trash.move

    def paused_move(self: Any, path: str) -> None:
        entered.set()
        assert go.wait(30)
        real(self, path)

    reports: list[Any] = []
    pool_gc._Trash.move = paused_move  # type: ignore[method-assign]
    try:
        first = threading.Thread(target=lambda: reports.append(collect_pool(pool, min_age_s=900)))
        first.start()
        assert entered.wait(30)
        before = files(tmp_path / "pool", "packs")
        with pytest.raises(PoolGcBusyError, match="collecting that pool already"):
            collect_pool(pool, min_age_s=900)
        assert files(tmp_path / "pool", "packs") == before  # the refused one moved nothing
        dry = collect_pool(pool, min_age_s=900, dry_run=True)  # a dry run takes no lease
        assert dry.dry_run
        go.set()
        first.join(30)
    finally:
        pool_gc._Trash.move = real  # type: ignore[method-assign]
        go.set()
    assert set(reports[0].removed_objects) == unreferenced
    assert collect_pool(pool, min_age_s=900).removed_objects == []  # the lease was released
    check_member(tmp_path, saved)


def test_a_collection_that_failed_leaves_the_lease_free(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    member(tmp_path, pool)
    garbage(tmp_path, pool, 1)
    age(tmp_path / "pool")
    real = pool_gc._Trash.move

    def broken(self: Any, path: str) -> None:
        raise OSError("disk failure")

    pool_gc._Trash.move = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="disk failure"):
            collect_pool(pool, min_age_s=900)
    finally:
        pool_gc._Trash.move = real  # type: ignore[method-assign]
    assert collect_pool(pool, min_age_s=900).removed_objects  # not refused


FROZEN = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from lightning_incremental.core.maintain import pool_gc

    pool_gc.POOL_LEASE_TTL_S = float(sys.argv[3])
    real, moves = pool_gc._Trash.move, []

    def move(self, path):
        moves.append(path)
        if len(moves) == 1:
            Path(sys.argv[2]).write_text(path)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen with the lease, before its first move
        real(self, path)

    pool_gc._Trash.move = move
    try:
        pool_gc.collect_pool(sys.argv[1], min_age_s=900)
    except pool_gc.PoolGcBusyError as exc:
        print("STOPPED", len(moves), exc, flush=True)
        sys.exit(3)
    print("FINISHED", len(moves), flush=True)
    """
)


def test_a_frozen_collection_is_refused_then_taken_over_and_stops_when_it_wakes(
    tmp_path: Path,
) -> None:
    """Real processes, a real SIGSTOP: the frozen holder's fresh lease refuses a second
    collection; once its heartbeat is older than the TTL the second takes over and collects;
    the holder, continued, stops at its next check having touched at most the object in flight."""
    pool = str(tmp_path / "pool")
    saved = member(tmp_path, pool)
    old = garbage(tmp_path, pool, 1) | garbage(tmp_path, pool, 2)
    age(tmp_path / "pool")
    # Unreferenced for 1,000 s: the frozen one (min_age_s=900) would move them, the one that
    # takes over (min_age_s=2,000) leaves them: what is left for the woken one to do.
    later = garbage(tmp_path, pool, 3) | garbage(tmp_path, pool, 4)
    then = time.time() - 1000
    for path in later:
        os.utime(tmp_path / "pool" / path, (then, then))
    paused, ttl = tmp_path / "paused", 6.0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN, pool, str(paused), str(ttl)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert child.poll() is None, child.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        frozen_at = time.monotonic()
        in_flight = paused.read_text()
        with pytest.raises(PoolGcBusyError, match="another collection of the pool is running"):
            collect_pool(pool, min_age_s=900)
        assert time.monotonic() - frozen_at < ttl - 1.5, "the refusal came too late to count"
        assert in_flight in files(tmp_path / "pool", "packs")  # nothing moved by either
        time.sleep(max(0.0, frozen_at + ttl + 1.0 - time.monotonic()))
        report = collect_pool(pool, min_age_s=2000)  # takes the stale lease over
        assert set(report.removed_objects) == old
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()
    assert child.returncode == 3, out
    assert "STOPPED" in out and "took the pool's lease over" in out, out
    assert int(out.split("STOPPED", 1)[1].split()[0]) == 1, out  # only the one in flight
    left = files(tmp_path / "pool", "packs")
    assert not left & old
    assert later - {in_flight} <= left, "the woken collection moved objects after its check"
    check_member(tmp_path, saved)
    torch.manual_seed(0)
