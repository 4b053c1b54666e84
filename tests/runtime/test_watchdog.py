"""The heartbeat watchdog: judgement as a pure function, then real threads over a real TCPStore."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.cluster.watchdog import (
    EXIT_PEER_DEAD,
    Failure,
    PeerTracker,
    Watchdog,
    WatchdogConfig,
    tcp_store_connector,
)

CONFIG = WatchdogConfig(heartbeat_interval=1, heartbeat_timeout=10, progress_timeout=100)
FAST = WatchdogConfig(heartbeat_interval=0.05, heartbeat_timeout=0.3, progress_timeout=0.8)


def beat(seq: int, step: int | None) -> dict:
    return {"seq": seq, "step": step, "time": 0.0}


def test_healthy_ranks_pass() -> None:
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 200):
        for rank in (0, 1):
            tracker.observe(rank, beat(t, t // 5), float(t))
        assert tracker.judge(float(t)) is None


def test_a_silent_rank_is_dead_after_the_timeout() -> None:
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 30):
        tracker.observe(0, beat(t, t), float(t))
        tracker.observe(1, beat(min(t, 5), min(t, 5)), float(t))  # rank 1 stops at t=5
        failure = tracker.judge(float(t))
        if t <= 15:
            assert failure is None, t
        else:
            assert failure == Failure("dead", 1, t - 5.0, 5)
            break
    else:
        pytest.fail("never judged dead")


def test_a_rank_that_never_beats_is_dead() -> None:
    tracker = PeerTracker(2, CONFIG, started=100.0)
    tracker.observe(0, beat(1, 1), 105.0)
    tracker.observe(1, None, 105.0)
    assert tracker.judge(109.0) is None
    failure = tracker.judge(111.0)
    assert failure is not None and failure.kind == "dead" and failure.rank == 1


def test_heartbeats_without_progress_are_hung() -> None:
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 120):
        tracker.observe(0, beat(t, t), float(t))
        tracker.observe(1, beat(t, 7 if t >= 7 else t), float(t))  # beats, stuck at step 7
    failure = tracker.judge(119.0)
    assert failure == Failure("hung", 1, 112.0, 7)
    assert failure.exit_code == 87 and "made no training progress" in failure.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heartbeat_interval": 0}, "positive"),
        ({"heartbeat_timeout": "10"}, "positive"),
        ({"heartbeat_interval": 5, "heartbeat_timeout": 10}, "at least 3"),
        ({"heartbeat_timeout": 60, "progress_timeout": 60}, "longer than"),
    ],
)
def test_config_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WatchdogConfig(**kwargs)


@pytest.fixture
def tcp_store():
    master = TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    yield master
    del master


def _watch(store: TCPStore, rank: int, config: WatchdogConfig = FAST):
    found = threading.Event()
    failures: list[Failure] = []

    def on_failure(failure: Failure) -> None:
        failures.append(failure)
        found.set()

    dog = Watchdog(
        tcp_store_connector("127.0.0.1", store.port),
        rank,
        2,
        config,
        on_failure=on_failure,
        prefix="test/hb",
    )
    return dog, found, failures


def test_threads_detect_a_dead_peer_over_a_real_store(tcp_store) -> None:
    dog, found, failures = _watch(tcp_store, 0)
    peer_stop = threading.Event()

    def peer() -> None:  # rank 1 beats three times, then dies silently
        client = tcp_store_connector("127.0.0.1", tcp_store.port)()
        for seq in range(3):
            client.set("test/hb/1", json.dumps(beat(seq, seq)))
            if peer_stop.wait(FAST.heartbeat_interval):
                return

    threading.Thread(target=peer, daemon=True).start()
    with dog:
        for step in range(1000):
            dog.progress(step)
            if found.wait(0.02):
                break
    peer_stop.set()
    assert found.is_set(), "the dead peer was never noticed"
    (failure,) = failures
    assert failure.kind == "dead" and failure.rank == 1
    names = {t.name for t in threading.enumerate()}
    assert not any(
        n.startswith("li-heartbeat-rank0") or n.startswith("li-monitor-rank0") for n in names
    ), "threads must end after firing"


def test_threads_detect_a_hung_peer(tcp_store) -> None:
    dog, found, failures = _watch(tcp_store, 0)
    peer_dog, _, _ = _watch(tcp_store, 1)
    peer_dog.progress(3)  # rank 1's heartbeat runs, its step never moves
    with dog, peer_dog:
        for step in range(1000):
            dog.progress(step)
            if found.wait(0.02):
                break
    assert failures and failures[0].kind == "hung" and failures[0].rank == 1
    assert failures[0].step == 3


def test_an_unreachable_store_isolates_this_rank() -> None:
    calls = {"n": 0}

    class Flaky:
        def set(self, key, value):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] > 2:
                raise ConnectionError("store unreachable")

        def get(self, key):  # type: ignore[no-untyped-def]
            raise ConnectionError("store unreachable")

        def check(self, keys):  # type: ignore[no-untyped-def]
            raise ConnectionError("store unreachable")

    found = threading.Event()
    failures: list[Failure] = []
    dog = Watchdog(Flaky, 0, 2, FAST, on_failure=lambda f: (failures.append(f), found.set()))
    with dog:
        assert found.wait(10)
    assert failures[0].kind == "isolated" and failures[0].exit_code == 88


def test_default_action_ends_the_process_with_the_documented_code(tcp_store) -> None:
    code = (
        "import time\n"
        "from lightning_incremental.runtime.cluster.watchdog import Watchdog, WatchdogConfig, "
        "tcp_store_connector\n"
        "c = WatchdogConfig(heartbeat_interval=0.05, heartbeat_timeout=0.3, progress_timeout=1)\n"
        f"d = Watchdog(tcp_store_connector('127.0.0.1', {tcp_store.port}), 0, 2, c).start()\n"
        "for step in range(2000):\n"
        "    d.progress(step); time.sleep(0.01)\n"
        "print('never noticed')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == EXIT_PEER_DEAD, out.stdout + out.stderr
    assert "rank 1 sent no heartbeat" in out.stderr


def test_batches_without_a_new_step_are_progress() -> None:
    """Gradient accumulation and validation move no training step, but they are progress."""
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 300):
        tracker.observe(0, {"seq": t, "step": 4, "progress": t}, float(t))
        tracker.observe(1, {"seq": t, "step": 4, "progress": t // 50}, float(t))
        assert tracker.judge(float(t)) is None, t


def test_a_rank_that_finished_is_not_taken_for_dead() -> None:
    tracker = PeerTracker(2, CONFIG, started=0.0)
    tracker.observe(0, beat(1, 1), 0.0)
    tracker.observe(1, beat(1, 1), 0.0)
    tracker.observe(1, {"stopped": True, "step": 1}, 1.0)
    for t in range(2, 200):
        tracker.observe(0, beat(t, t), float(t))
        tracker.observe(1, {"stopped": True, "step": 1}, float(t))
    assert tracker.judge(199.0) is None


def test_a_peer_that_stops_normally_ends_nothing_over_a_real_store(tcp_store) -> None:
    dog, found, failures = _watch(tcp_store, 0)
    peer, _, peer_failures = _watch(tcp_store, 1)
    with dog:
        with peer:
            for step in range(5):
                dog.progress(step)
                peer.progress(step)
        # the peer stopped (finished); this rank goes on for several heartbeat timeouts
        for step in range(5, 5 + int(4 * FAST.heartbeat_timeout / 0.02)):
            dog.progress(step)
            assert not found.wait(0.02), failures
    assert not failures and not peer_failures


def test_a_failing_rank_does_not_say_it_stopped(tcp_store) -> None:
    dog, _, _ = _watch(tcp_store, 1)
    with dog:
        dog.progress(1)
    client = tcp_store_connector("127.0.0.1", tcp_store.port)()
    dog2, _, _ = _watch(tcp_store, 0)
    dog2.start()
    while not client.check(["test/hb/0"]):  # its first heartbeat
        threading.Event().wait(0.01)
    dog2.stop(finished=False)
    assert json.loads(client.get("test/hb/1"))["stopped"] is True
    assert "stopped" not in json.loads(client.get("test/hb/0"))


def test_the_job_store_is_found_from_the_environment(monkeypatch) -> None:
    from lightning_incremental.runtime.cluster.watchdog import job_store_address

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert job_store_address() == ("10.1.2.3", 29511)
    monkeypatch.delenv("MASTER_PORT")
    assert job_store_address() is None


def test_the_hang_check_is_armed_by_a_rank_s_first_progress() -> None:
    """Setup (a long resume from object storage, compiling the first step) is not a hang."""
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 500):
        tracker.observe(0, {"seq": t, "step": None, "progress": 0}, float(t))
        tracker.observe(1, {"seq": t, "step": None, "progress": 0}, float(t))
        assert tracker.judge(float(t)) is None, t
    tracker.observe(1, {"seq": 500, "step": 0, "progress": 1}, 500.0)
    for t in range(501, 700):
        tracker.observe(0, {"seq": t, "step": None, "progress": 0}, float(t))
        tracker.observe(1, {"seq": t, "step": 0, "progress": 1}, float(t))
    failure = tracker.judge(699.0)
    assert failure is not None and failure.kind == "hung" and failure.rank == 1


def test_of_ranks_stuck_together_the_one_furthest_behind_is_named() -> None:
    """Rank 1 stops outside a collective, rank 0 then waits inside it: neither progresses."""
    tracker = PeerTracker(3, CONFIG, started=0.0)
    for t in range(0, 200):
        tracker.observe(0, {"seq": t, "step": 9, "progress": 9}, float(t))
        tracker.observe(1, {"seq": t, "step": 8, "progress": 8}, float(t))
        tracker.observe(2, {"seq": t, "step": 9, "progress": 9}, float(t))
    failure = tracker.judge(199.0)
    assert failure is not None and failure.kind == "hung" and failure.rank == 1


def test_the_rank_behind_is_named_even_when_its_last_progress_was_seen_later() -> None:
    """Under load a heartbeat can publish late: rank 1 (stuck outside the collective, one batch
    behind) is seen making its last progress after rank 0 (waiting inside it). When rank 0 passes
    the timeout first, rank 1 is still the one named: the culprit is the rank furthest behind of
    all that stopped, not the first to pass the timeout."""
    tracker = PeerTracker(2, CONFIG, started=0.0)
    tracker.observe(0, {"seq": 1, "step": 9, "progress": 9}, 1.0)
    tracker.observe(1, {"seq": 1, "step": 8, "progress": 8}, 5.0)  # published late
    for t in range(6, 104):
        tracker.observe(0, {"seq": t, "step": 9, "progress": 9}, float(t))
        tracker.observe(1, {"seq": t, "step": 8, "progress": 8}, float(t))
    assert tracker.judge(103.0) is not None  # rank 0 is past the timeout, rank 1 not yet
    failure = tracker.judge(103.0)
    assert failure is not None and failure.kind == "hung" and failure.rank == 1, failure


def test_a_rank_still_progressing_is_not_blamed_for_another_hang() -> None:
    tracker = PeerTracker(2, CONFIG, started=0.0)
    for t in range(0, 200):
        tracker.observe(0, {"seq": t, "step": 5, "progress": 5}, float(t))
        tracker.observe(1, {"seq": t, "step": 1 + t // 50, "progress": 1 + t // 50}, float(t))
    failure = tracker.judge(199.0)  # rank 1 has fewer batches, but it still progresses
    assert failure is not None and failure.rank == 0, failure


def test_a_dropped_checkpointer_stops_its_watchdog_without_waiting_for_it(tcp_store) -> None:
    """The finalizer of a checkpointer dropped without close() runs on whatever thread the
    garbage collector does; that thread may hold a lock a watchdog thread waits for (here: the
    lock its store client takes). Stopping must not join the watchdog's threads there."""
    from accelerate_incremental._progress import stop_dropped

    held = threading.Lock()
    waiting = threading.Event()

    class Client:
        def __init__(self) -> None:
            self.inner = tcp_store_connector("127.0.0.1", tcp_store.port)()

        def set(self, key: str, value: str) -> None:
            if held.locked():
                waiting.set()
            with held:
                self.inner.set(key, value)

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self.inner, name)

    dog = Watchdog(Client, 0, 1, FAST, on_failure=lambda f: None, prefix="test/dropped")
    dog.start()
    stopped = threading.Event()
    with held:  # the finalizing thread's lock
        assert waiting.wait(10)  # the heartbeat thread waits for it
        finalizer = threading.Thread(target=lambda: (stop_dropped(dog), stopped.set()))
        finalizer.start()
        assert stopped.wait(10), "the finalizer waited for the watchdog's threads"
    for thread in dog._threads:  # released: they see the stop and end alone
        thread.join(10)
        assert not thread.is_alive()
