"""Heartbeat watchdog: notice dead, hung and isolated ranks, and end the process on purpose.

Each rank runs two named daemon threads with their own clients of the job's
``torch.distributed`` TCPStore (under torchrun it is hosted by the elastic agent and survives
worker deaths):

- the *heartbeat* publishes ``{"seq", "step", "progress", "time"}`` under ``<prefix>/<rank>``
  every ``heartbeat_interval`` seconds; ``seq`` grows every beat, ``progress`` every call of
  :meth:`Watchdog.progress` (each training or validation batch), ``step`` is the training step
  reported last; a rank that stops its watchdog normally publishes ``"stopped"`` and is no longer
  watched (it finished; the others must not take it for dead);
- the *monitor* reads every rank's record (its own included) and judges by what it observes on
  its own monotonic clock — never by comparing clocks across hosts:
  * **dead**: a rank's ``seq`` has not changed for ``heartbeat_timeout`` seconds;
  * **hung**: ``seq`` moves but ``progress`` has not changed for ``progress_timeout`` seconds
    (a rank stuck in a collective; one stuck in a call that holds the GIL shows up as dead);
  * **isolated**: this rank could not reach the store for ``heartbeat_timeout`` seconds: it
    fences itself (it must stop committing) and exits.

On a finding the watchdog logs who, what and for how long, then calls ``on_failure``; the
default ends the process with :func:`os._exit` and a distinct exit code (a thread cannot
``sys.exit`` the process), so the elastic agent restarts the group, which resumes from the newest
committed checkpoint. It never waits out a collective timeout.

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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from lightning_incremental.core.errors import ConfigError

log = logging.getLogger("lightning_incremental")

EXIT_PEER_DEAD = 86
EXIT_PEER_HUNG = 87
EXIT_ISOLATED = 88


class KeyValueStore(Protocol):
    """What the watchdog needs of a ``torch.distributed.Store``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    """Watchdog timing, in seconds.

    Attributes:
        heartbeat_interval: how often each rank publishes a heartbeat and checks the others.
        heartbeat_timeout: a rank whose heartbeat has not changed for this long is dead; a rank
            that cannot reach the store for this long is isolated. At least 3 intervals.
        progress_timeout: a rank whose training step has not changed for this long is hung.
            Longer than the slowest legitimate step (evaluation, a checkpoint, data loading).
    """

    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 60.0
    progress_timeout: float = 900.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "heartbeat_timeout", "progress_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout < 3 * self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout}s) must be at least 3 heartbeat "
                f"intervals ({3 * self.heartbeat_interval}s), or one late beat kills the job"
            )
        if self.progress_timeout <= self.heartbeat_timeout:
            raise ConfigError(
                f"progress_timeout ({self.progress_timeout}s) must be longer than "
                f"heartbeat_timeout ({self.heartbeat_timeout}s)"
            )


@dataclass(frozen=True)
class Failure:
    """What the monitor found."""

    kind: str  # "dead" | "hung" | "isolated"
    rank: int  # the rank it concerns
    seconds: float  # how long the condition has lasted
    step: int | None  # the rank's last reported training step

    @property
    def exit_code(self) -> int:
        return {"dead": EXIT_PEER_DEAD, "hung": EXIT_PEER_HUNG}.get(self.kind, EXIT_ISOLATED)

    def describe(self) -> str:
        what = {
            "dead": "sent no heartbeat",
            "hung": "made no training progress",
            "isolated": "could not reach the coordination store",
        }[self.kind]
        return f"rank {self.rank} {what} for {self.seconds:.1f}s (last step {self.step})"


@dataclass
class _Seen:
    seq: int = -1
    step: int | None = None
    progress: Any = None
    seq_since: float = 0.0
    step_since: float = 0.0
    stopped: bool = False


@dataclass
class PeerTracker:
    """The monitor's judgement, as a pure function of observations and a clock."""

    world_size: int
    config: WatchdogConfig
    started: float
    seen: dict[int, _Seen] = field(default_factory=dict)

    def observe(self, rank: int, record: dict[str, Any] | None, now: float) -> None:
        """Record what rank ``rank`` published (None: nothing yet)."""
        state = self.seen.setdefault(rank, _Seen(seq_since=self.started, step_since=self.started))
        if record is None:
            return
        if record.get("stopped") is True:
            state.stopped = True
            return
        seq, step = record.get("seq"), record.get("step")
        progress = record.get("progress", step)
        if isinstance(seq, int) and seq != state.seq:
            state.seq, state.seq_since = seq, now
        state.step = step
        if progress != state.progress:
            state.progress, state.step_since = progress, now

    def judge(self, now: float) -> Failure | None:
        """The first rank found dead, else — once a rank has made no progress for
        ``progress_timeout`` — the rank furthest behind of all that stopped (a rank stuck outside
        a collective stops the others inside it: all stop progressing, the culprit with the
        fewest batches done), else None.

        "Stopped" is no progress for half the timeout: the ranks waiting for the culprit stop
        about when it does, but a heartbeat published late under load can make the culprit's
        last progress *seen* later than theirs, so the first rank past the timeout is not
        necessarily the one to blame. Ties go to the rank seen stopping first, then the lower
        rank."""
        for rank in range(self.world_size):
            state = self.seen.get(rank, _Seen(seq_since=self.started, step_since=self.started))
            if not state.stopped and now - state.seq_since > self.config.heartbeat_timeout:
                return Failure("dead", rank, now - state.seq_since, state.step)
        stopped, timed_out = [], False
        for rank in range(self.world_size):
            state = self.seen.get(rank, _Seen(seq_since=self.started, step_since=self.started))
            if state.stopped or state.progress in (None, 0):
                continue  # armed at a rank's first progress: setup may legitimately be long
            idle = now - state.step_since
            timed_out = timed_out or idle > self.config.progress_timeout
            if idle > self.config.progress_timeout / 2:
                behind = state.progress if isinstance(state.progress, int) else 0
                failure = Failure("hung", rank, idle, state.step)
                stopped.append((behind, state.step_since, rank, failure))
        return min(stopped, key=lambda item: item[:3])[3] if timed_out else None


def _read_records(client: KeyValueStore, keys: list[str]) -> list[dict[str, Any] | None]:
    """Every key's record (None where a rank has not published yet): one round trip when all
    exist and the store has ``multi_get`` (a TCPStore does), else one per key."""
    multi_get = getattr(client, "multi_get", None)
    if multi_get is not None and client.check(keys):
        return [json.loads(value) for value in multi_get(keys)]
    return [json.loads(client.get(key)) if client.check([key]) else None for key in keys]


def _exit_process(failure: Failure) -> None:
    logging.shutdown()
    os._exit(failure.exit_code)


class Watchdog:
    """Heartbeat and monitor threads for one rank.

    Args:
        connect: returns a new client of the job's store (called once per thread), e.g.
            ``lambda: TCPStore(host, port, is_master=False, timeout=...)``.
        rank, world_size: this process's rank and the group's size.
        config: timings.
        on_failure: called once with the :class:`Failure`; default: log and ``os._exit`` with the
            failure's exit code.
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

    def stop(self, timeout: float | None = None, *, finished: bool = True) -> None:
        """Stop both threads. ``finished``: this rank is done (training ended normally), so it
        publishes ``stopped`` and the others stop watching it. Pass False when this rank is
        failing: if the others are left waiting for it, they must find it dead and restart."""
        if not self._stop.is_set():  # the first call decides
            self._finished = finished
            self._stop.set()
        atexit.unregister(self._at_exit)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

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

    def _records(self, client: KeyValueStore) -> list[dict[str, Any] | None]:
        return _read_records(client, [self._key(rank) for rank in range(self.world_size)])

    def _heartbeat(self) -> None:
        client: KeyValueStore | None = None
        seq = 0
        last_ok = self.clock()
        while not self._stop.is_set():
            try:
                if client is None:
                    client = self.connect()
                record = {
                    "seq": seq,
                    "step": self._step,
                    "progress": self._progress,
                    "time": time.time(),
                }
                client.set(self._key(self.rank), json.dumps(record))
                seq += 1
                last_ok = self.clock()
            except Exception as exc:  # the store is unreachable: isolated once it lasts
                client = None
                cut_off = self.clock() - last_ok
                log.warning(
                    "rank %d cannot publish its heartbeat (%.1fs): %s", self.rank, cut_off, exc
                )
                if cut_off > self.config.heartbeat_timeout:
                    self._fire(Failure("isolated", self.rank, cut_off, self._step))
                    return
            self._stop.wait(self.config.heartbeat_interval)
        if self._finished and self._failure is None:
            # Over the client already open (no new connection that could wait on a store whose
            # host has gone): the others stop watching this rank.
            try:
                client = client or self.connect()
                client.set(self._key(self.rank), json.dumps({"stopped": True, "step": self._step}))
            except Exception as exc:  # the others then judge this rank by its silence
                log.warning("rank %d could not publish that it stopped: %s", self.rank, exc)

    def _monitor(self) -> None:
        tracker = PeerTracker(self.world_size, self.config, started=self.clock())
        client: KeyValueStore | None = None
        while not self._stop.wait(self.config.heartbeat_interval):
            now = self.clock()
            try:
                if client is None:
                    client = self.connect()
                for rank, record in enumerate(self._records(client)):
                    tracker.observe(rank, record, now)
            except Exception as exc:  # judged by the heartbeat thread (isolated)
                client = None
                log.warning("rank %d cannot read heartbeats: %s", self.rank, exc)
                continue
            failure = tracker.judge(now)
            if failure is not None:
                self._fire(failure)
                return


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
