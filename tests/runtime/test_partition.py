"""A partitioned rank, behind a real TCP forwarder that cuts its link to the job's TCPStore
(every byte held back, the sockets kept open): both sides of the partition find it within the
heartbeat timeout, and nothing of the watchdog blocks for the length of the cut.

And the monitor's traffic: with the coordinator reading every heartbeat and the others reading
only its verdict, store operations and bytes per interval grow linearly with the ranks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from lightning_incremental.runtime.cluster import bounded
from lightning_incremental.runtime.cluster.watchdog import (
    EXIT_ISOLATED,
    EXIT_PEER_DEAD,
    Failure,
    Monitor,
    Watchdog,
    WatchdogConfig,
    tcp_store_connector,
)
from tests.forwarder import Forwarder

CONFIG = WatchdogConfig(heartbeat_interval=0.2, heartbeat_timeout=1.0, progress_timeout=30.0)
SLACK_S = 1.5  # thread scheduling on a loaded machine (the old code never found it at all)


@pytest.fixture
def tcp_store() -> Iterator[TCPStore]:
    master = TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    yield master
    del master


class Rank:
    """A watchdog of one rank, its findings with the time each was made, and a training loop
    that reports progress."""

    def __init__(self, port: int, rank: int) -> None:
        self.found: list[tuple[Failure, float]] = []
        self.event = threading.Event()
        self.dog = Watchdog(
            tcp_store_connector("127.0.0.1", port, timeout=CONFIG.heartbeat_timeout),
            rank,
            2,
            CONFIG,
            on_failure=self._on_failure,
            prefix="test/partition",
        )
        self._training = threading.Event()

    def _on_failure(self, failure: Failure) -> None:
        self.found.append((failure, time.monotonic()))
        self.event.set()

    def start(self) -> Rank:
        self.dog.start()
        threading.Thread(target=self._train, daemon=True).start()
        return self

    def _train(self) -> None:
        step = 0
        while not self._training.wait(0.05):
            step += 1
            self.dog.progress(step)

    def stop_training(self) -> None:
        self._training.set()


def _stop_within(dog: Watchdog, seconds: float) -> float:
    """How long ``dog.stop(finished=False)`` took; fails if it did not return within ``seconds``
    (it is run on a thread so that a blocked stop cannot hang the test)."""
    start = time.monotonic()
    thread = threading.Thread(target=dog.stop, kwargs={"finished": False}, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"Watchdog.stop blocked for more than {seconds}s"
    return time.monotonic() - start


@pytest.mark.parametrize("cut_rank", [1, 0], ids=["a follower is cut off", "the coordinator is"])
def test_both_sides_of_a_partition_find_it_within_the_timeout(
    tcp_store: TCPStore, cut_rank: int
) -> None:
    with Forwarder(("127.0.0.1", tcp_store.port)) as link:
        ports = {cut_rank: link.port, 1 - cut_rank: tcp_store.port}
        ranks = [Rank(ports[0], 0).start(), Rank(ports[1], 1).start()]
        try:
            time.sleep(5 * CONFIG.heartbeat_interval)
            assert not any(r.found for r in ranks), "a healthy group must raise nothing"
            link.cut()
            cut = time.monotonic()
            for r in ranks:
                assert r.event.wait(15), f"rank {ranks.index(r)} found nothing in 15s of cut"
            isolated, other = ranks[cut_rank], ranks[1 - cut_rank]
            (failure, when), *_ = isolated.found
            assert failure.kind == "isolated" and failure.rank == cut_rank
            assert failure.exit_code == EXIT_ISOLATED
            limit = CONFIG.heartbeat_timeout + CONFIG.heartbeat_interval + SLACK_S
            assert when - cut <= limit, f"isolated found {when - cut:.2f}s after the cut"
            (failure, when), *_ = other.found
            assert failure.kind == "dead" and failure.rank == cut_rank
            assert failure.exit_code == EXIT_PEER_DEAD
            assert when - cut <= limit + CONFIG.heartbeat_interval, f"{when - cut:.2f}s"
            # The link is still cut: the cut-off rank's watchdog stops at once all the same.
            assert _stop_within(isolated.dog, 2.0) < 1.0
        finally:
            for r in ranks:
                r.stop_training()
            _stop_within(ranks[1 - cut_rank].dog, 5.0)
            link.heal()


def test_stop_returns_at_once_while_a_store_call_is_blocked(tcp_store: TCPStore) -> None:
    """A watchdog whose every store call blocks (the link was cut before it started) stops
    within a moment when asked to, and leaves only lanes that end when the link heals."""
    with Forwarder(("127.0.0.1", tcp_store.port)) as link:
        link.cut()
        rank = Rank(link.port, 1).start()
        time.sleep(3 * CONFIG.heartbeat_interval)
        assert _stop_within(rank.dog, 2.0) < 1.0
        rank.stop_training()
        link.heal()


def test_a_bounded_call_gives_up_at_its_deadline_and_stuck_lanes_are_capped() -> None:
    release = threading.Event()
    store = bounded.BoundedStore(lambda: object(), "test-lane")
    assert store.call(lambda client: 42, 1.0) == 42
    start = time.monotonic()
    for _ in range(bounded.MAX_STUCK):
        with pytest.raises(bounded.StoreTimeout):
            store.call(lambda client: release.wait(30), 0.2)
    assert time.monotonic() - start < 0.2 * bounded.MAX_STUCK + 1.0
    with pytest.raises(bounded.StoreTimeout, match="still blocked"):  # no third thread
        store.call(lambda client: 1, 5.0)
    release.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert store.call(lambda client: 7, 1.0) == 7
            break
        except bounded.StoreTimeout:
            time.sleep(0.05)
    else:
        pytest.fail("the store never became usable after the stuck calls returned")
    stop = threading.Event()
    store = bounded.BoundedStore(lambda: object(), "test-lane", stop)
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(bounded.Stopped):
        store.call(lambda client: threading.Event().wait(30), 30.0)


def test_a_verdict_naming_this_rank_dead_isolates_it() -> None:
    """The coordinator has had no heartbeat from this rank (its writes do not get through)
    although this rank can read: to the group it is cut off, and it ends with 88."""
    verdict = {"seq": 3, "failure": {"kind": "dead", "rank": 1, "seconds": 4.0, "step": 7}}
    store = {"p/verdict": json.dumps(verdict)}
    monitor = Monitor(1, 2, CONFIG, "p", started=0.0)
    failure = monitor.step(lambda fn, timeout: fn(_DictStore(store)), lambda: 0.5)
    assert failure is not None and failure.kind == "isolated" and failure.rank == 1
    assert "as rank 0 found" in failure.describe()
    verdict["failure"]["rank"] = 0  # another rank's failure is relayed as it is
    store["p/verdict"] = json.dumps(verdict)
    failure = monitor.step(lambda fn, timeout: fn(_DictStore(store)), lambda: 0.6)
    assert failure is not None and (failure.kind, failure.rank) == ("dead", 0)


def test_a_stale_verdict_is_a_dead_coordinator_and_a_stopped_one_is_not() -> None:
    store = {"p/verdict": json.dumps({"seq": 1, "failure": None})}
    monitor = Monitor(1, 2, CONFIG, "p", started=0.0)
    call = lambda fn, timeout: fn(_DictStore(store))  # noqa: E731
    assert monitor.step(call, lambda: 0.2) is None
    assert monitor.step(call, lambda: 1.0) is None
    failure = monitor.step(call, lambda: 1.3)
    assert failure is not None and (failure.kind, failure.rank) == ("dead", 0)
    store["p/verdict"] = json.dumps({"stopped": True})
    fresh = Monitor(1, 2, CONFIG, "p", started=0.0)
    assert all(fresh.step(call, lambda t=t: t) is None for t in (0.5, 5.0, 50.0))


class _DictStore:
    """A store over a dict that counts operations and the bytes of keys and values moved."""

    def __init__(self, data: dict[str, str] | None = None) -> None:
        self.data = data if data is not None else {}
        self.ops = 0
        self.bytes = 0

    def set(self, key: str, value: str) -> None:
        self.ops += 1
        self.bytes += len(key) + len(value)
        self.data[key] = value

    def get(self, key: str) -> bytes:
        self.ops += 1
        value = self.data[key]
        self.bytes += len(key) + len(value)
        return value.encode()

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        self.bytes += sum(len(k) for k in keys)
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops += 1
        values = [self.data[k] for k in keys]
        self.bytes += sum(len(k) for k in keys) + sum(len(v) for v in values)
        return [v.encode() for v in values]


def _one_interval(ranks: int) -> tuple[int, int]:
    """Store operations and bytes of one steady interval of ``ranks`` simulated ranks: every
    heartbeat written (as the heartbeat threads do), then every rank's monitor step."""
    store = _DictStore()
    prefix = "lightning_incremental/heartbeat/g0/w0"
    monitors = [Monitor(r, ranks, CONFIG, prefix, started=0.0) for r in range(ranks)]
    record: dict[str, Any] = {"seq": 0, "step": 1000, "progress": 1000, "time": 1.7e9}
    for t in (0.2, 0.4):  # the first interval fills the store; the second is measured
        store.ops = store.bytes = 0
        for r in range(ranks):
            record["seq"] += 1
            store.set(f"{prefix}/{r}", json.dumps(record))
        for monitor in monitors:
            assert monitor.step(lambda fn, timeout: fn(store), lambda t=t: t) is None
    return store.ops, store.bytes


def test_monitor_traffic_grows_linearly_with_the_ranks() -> None:
    costs = {n: _one_interval(n) for n in (8, 64, 256, 1024)}
    bytes8 = costs[8][1]
    for n, (ops, nbytes) in costs.items():
        assert ops <= 3 * n + 3, f"{ops} operations per interval for {n} ranks"
        # per rank, no more than at 8 ranks (10 % for longer rank numbers in the keys)
        assert nbytes / n <= 1.1 * bytes8 / 8, f"{nbytes} bytes per interval for {n} ranks"
    print({n: {"ops": ops, "bytes": b} for n, (ops, b) in costs.items()})
