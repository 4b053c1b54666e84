"""Heartbeat watchdog: notice dead, hung and isolated ranks, and end the process on purpose.

Each rank runs two named daemon threads over the job's ``torch.distributed`` TCPStore (under
torchrun it is hosted by the elastic agent and survives worker deaths). Every call they make
into the store is bounded by a deadline (:mod:`~lightning_incremental.runtime.cluster.bounded`): a
TCPStore client blocks for as long as a silently cut link lasts, whatever its timeout.

- the *heartbeat* publishes ``{"seq", "step", "progress", "time"}`` under ``<prefix>/<rank>``
  every ``heartbeat_interval`` seconds; ``seq`` grows every beat, ``progress`` every call of
  :meth:`Watchdog.progress` (each training or validation batch), ``step`` is the training step
  reported last; a rank that stops its watchdog normally publishes ``"stopped"`` and is no longer
  watched (it finished; the others must not take it for dead);
- the *monitor* (:class:`Monitor`): on the coordinator (rank 0) it reads every rank's record and
  publishes a small verdict under ``<prefix>/verdict``; on every other rank it reads only the
  verdict. Judgement is by what a rank observes on its own monotonic clock — never by comparing
  clocks across hosts:
  * **dead**: a rank's ``seq`` has not changed for ``heartbeat_timeout`` seconds (the
    coordinator's: its verdict has not changed for that long);
  * **hung**: ``seq`` moves but ``progress`` has not changed for ``progress_timeout`` seconds
    (a rank stuck in a collective; one stuck in a call that holds the GIL shows up as dead);
  * **isolated**: this rank could not complete a read of the store — a round trip, not a write
    that expects no answer — for ``heartbeat_timeout`` seconds, or the coordinator's verdict says
    it has not heard from this rank for that long.

Traffic per interval, for N ranks: N heartbeat writes, one read of N records by the coordinator
and one write of its verdict, N - 1 reads of the verdict (a ``check`` and a ``get`` each): O(N)
operations and bytes through the one store, where reading every record on every rank was N².

On a finding the watchdog logs who, what and for how long, then calls ``on_failure``; the
default fences this process off (:func:`~lightning_incremental.core.commit.fencing.fence_process`:
no commit or deletion from it afterwards) and ends it with :func:`os._exit` and a distinct exit
code (a thread cannot ``sys.exit`` the process), so the elastic agent restarts the group, which
resumes from the newest committed checkpoint. It never waits out a collective timeout. Both sides
of a partition end: the isolated rank with 88, the others with 86 (the rank they lost).

Exit codes: ``EXIT_PEER_DEAD`` (86), ``EXIT_PEER_HUNG`` (87), ``EXIT_ISOLATED`` (88).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from lightning_incremental.core.commit.fencing import fence_process
from lightning_incremental.core.errors import ConfigError
from lightning_incremental.runtime.cluster.bounded import BoundedStore, KeyValueStore, Stopped
from lightning_incremental.runtime.cluster.judgement import (
    COORDINATOR,
    EXIT_ISOLATED,
    EXIT_PEER_DEAD,
    EXIT_PEER_HUNG,
    VERDICT,
    Failure,
    Monitor,
    PeerTracker,
    WatchdogConfig,
    setter,
)

log = logging.getLogger("lightning_incremental")

__all__ = [  # the judgement's names are the watchdog's too
    "EXIT_ISOLATED",
    "EXIT_PEER_DEAD",
    "EXIT_PEER_HUNG",
    "Failure",
    "KeyValueStore",
    "Monitor",
    "PeerTracker",
    "Watchdog",
    "WatchdogConfig",
    "job_store_address",
    "tcp_store_connector",
    "watch_job",
]

STOP_TIMEOUT_S = 5.0  # how long Watchdog.stop waits for its threads by default
STOP_PUBLISH_S = 2.0  # how long a finishing rank tries to say so


def _exit_process(failure: Failure) -> None:
    """The default action: fence this process off (no store of it commits or deletes from now
    on, a save queued on a saver thread included), then end it with the failure's exit code."""
    fence_process(failure.describe())
    logging.shutdown()
    os._exit(failure.exit_code)


class Watchdog:
    """Heartbeat and monitor threads for one rank.

    Args:
        connect: returns a new client of the job's store (called once per lane: see
            :mod:`~lightning_incremental.runtime.cluster.bounded`), e.g.
            ``lambda: TCPStore(host, port, is_master=False, timeout=...)``.
        rank, world_size: this process's rank and the group's size.
        config: timings.
        on_failure: called once with the :class:`Failure`; default: fence this process off, log
            and ``os._exit`` with the failure's exit code.
        clock: monotonic seconds (injectable for tests).
        prefix: the store keys' prefix; include the generation so a restarted group starts clean.
    """

    def __init__(
        self,
        connect: Callable[[], KeyValueStore],
        rank: int,
        world_size: int,
        config: WatchdogConfig | None = None,
        *,
        on_failure: Callable[[Failure], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefix: str = "lightning_incremental/heartbeat",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a group of {world_size}")
        self.connect, self.rank, self.world_size = connect, rank, world_size
        self.config = config or WatchdogConfig()
        self.on_failure = on_failure or _exit_process
        self.clock, self.prefix = clock, prefix
        self._step: int | None = None
        self._progress = 0
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._failure: Failure | None = None
        self._threads: list[threading.Thread] = []
        self._finished = False  # publish "stopped" when the heartbeat thread ends

    @property
    def failure(self) -> Failure | None:
        return self._failure

    def progress(self, step: int | None = None) -> None:
        """Report progress: a batch done (cheap: two attribute writes; call it every batch),
        and the training step if given."""
        self._progress += 1
        if step is not None:
            self._step = step

    def start(self) -> Watchdog:
        if self._threads:
            return self
        for name, target in (("heartbeat", self._heartbeat), ("monitor", self._monitor)):
            thread = threading.Thread(target=target, name=f"li-{name}-rank{self.rank}", daemon=True)
            self._threads.append(thread)
            thread.start()
        # A process that ends without stopping its watchdog (a script that never calls close)
        # still tells the others it is done, rather than leave them to find it dead.
        atexit.register(self._at_exit)
        return self

    def _at_exit(self) -> None:
        self.stop(timeout=2 * self.config.heartbeat_interval)

    def stop(self, timeout: float | None = STOP_TIMEOUT_S, *, finished: bool = True) -> None:
        """Stop both threads, waiting at most ``timeout`` seconds (every store call of theirs
        is bounded, and one in flight is abandoned at once: they end within a moment, or
        within :data:`STOP_PUBLISH_S` while this rank says it finished). ``finished``: this
        rank is done (training ended normally), so it publishes ``stopped`` and the others stop
        watching it. Pass False when this rank is failing: if the others are left waiting for
        it, they must find it dead and restart."""
        if not self._stop.is_set():  # the first call decides
            self._finished = finished
            self._stop.set()
        atexit.unregister(self._at_exit)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("watchdog thread %s did not end within %ss", thread.name, timeout)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _fire(self, failure: Failure) -> None:
        if not self._fired.acquire(blocking=False):
            return  # the first finding wins
        self._failure = failure
        self._stop.set()
        log.error(
            "watchdog on rank %d: %s; ending this process with exit code %d so the group "
            "restarts from the newest committed checkpoint",
            self.rank,
            failure.describe(),
            failure.exit_code,
        )
        self.on_failure(failure)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _heartbeat(self) -> None:
        store = BoundedStore(self.connect, f"li-store-heartbeat-rank{self.rank}", self._stop)
        seq = 0
        try:
            while not self._stop.is_set():
                payload = json.dumps(
                    {
                        "seq": seq,
                        "step": self._step,
                        "progress": self._progress,
                        "time": time.time(),
                    }
                )
                try:
                    store.call(setter(self._key(self.rank), payload), self.config.heartbeat_timeout)
                    seq += 1
                except Stopped:
                    break
                except Exception as exc:  # judged by the monitor: it needs a round trip
                    log.warning("rank %d cannot publish its heartbeat: %s", self.rank, exc)
                self._stop.wait(self.config.heartbeat_interval)
            if self._finished and self._failure is None:
                self._publish_stopped(store)
        finally:
            store.close()

    def _publish_stopped(self, store: BoundedStore) -> None:
        """Tell the others this rank finished (the coordinator: that it judges no more), within
        :data:`STOP_PUBLISH_S`; if the store cannot be reached the others judge by silence."""
        records = [(self._key(self.rank), {"stopped": True, "step": self._step})]
        if self.rank == COORDINATOR:
            records.append((f"{self.prefix}/{VERDICT}", {"stopped": True}))
        for key, record in records:
            try:
                store.call(setter(key, json.dumps(record)), STOP_PUBLISH_S, interruptible=False)
            except Exception as exc:
                log.warning("rank %d could not publish that it stopped: %s", self.rank, exc)
                return

    def _monitor(self) -> None:
        store = BoundedStore(self.connect, f"li-store-monitor-rank{self.rank}", self._stop)
        monitor = Monitor(self.rank, self.world_size, self.config, self.prefix, self.clock())
        try:
            while not self._stop.wait(self.config.heartbeat_interval):
                monitor.step_seen = self._step
                try:
                    failure = monitor.step(store.call, self.clock)
                except Stopped:
                    return
                if failure is not None:
                    self._fire(failure)
                    return
        finally:
            store.close()


_WATCHES = itertools.count()  # every rank starts its watchdogs in the same order


def watch_job(
    config: WatchdogConfig,
    *,
    rank: int,
    world_size: int,
    generation: int,
    address: tuple[str, int] | None = None,
) -> Watchdog:
    """Start a :class:`Watchdog` for this rank of a running job, over the job's own TCPStore
    (see :func:`job_store_address`), under keys of this generation.

    Raises:
        ConfigError: no TCPStore to use (not launched by torchrun, Lightning or Accelerate).
    """
    address = address or job_store_address()
    if address is None:
        raise ConfigError(
            "the watchdog needs the job's torch.distributed TCPStore, but there is no default "
            "process group store and no MASTER_ADDR/MASTER_PORT: launch the job with torchrun, "
            "Lightning's DDP or accelerate launch, or turn the watchdog off"
        )
    prefix = f"lightning_incremental/heartbeat/g{generation}/w{next(_WATCHES)}"
    log.info(
        "watchdog on rank %d of %d over %s:%d (interval %.1fs, timeouts %.1fs / %.1fs)",
        rank,
        world_size,
        *address,
        config.heartbeat_interval,
        config.heartbeat_timeout,
        config.progress_timeout,
    )
    # A store call may block no longer than a heartbeat may be late: an unreachable store must
    # be noticed within heartbeat_timeout, not within TCPStore's default 30 s or more.
    connect = tcp_store_connector(*address, timeout=config.heartbeat_timeout)
    return Watchdog(connect, rank, world_size, config, prefix=prefix).start()


def job_store_address() -> tuple[str, int] | None:
    """Host and port of the job's TCPStore: the default process group's store (torchrun's
    agent store, Lightning's or Accelerate's rendezvous), else ``MASTER_ADDR``/``MASTER_PORT``;
    None when there is neither."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            while isinstance(store, dist.PrefixStore):
                store = store.underlying_store
            if isinstance(store, dist.TCPStore):
                return store.host, store.port
    except Exception as exc:  # a store of another kind: fall back to the environment
        log.debug("no TCPStore behind the default process group: %s", exc)
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and port.isdigit():
        return host, int(port)
    return None


def tcp_store_connector(host: str, port: int, timeout: float = 30.0) -> Callable[[], KeyValueStore]:
    """A ``connect`` for :class:`Watchdog`: a new TCPStore client per call."""

    def connect() -> KeyValueStore:
        from torch.distributed import TCPStore

        return TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )

    return connect
