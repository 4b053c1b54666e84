"""The watchdog's judgement, without threads: timings, findings and their exit codes, the
coordinator's view of every rank (:class:`PeerTracker`), and one rank's monitor step over calls
bounded by a deadline (:class:`Monitor`). :mod:`~lightning_incremental.runtime.cluster.watchdog`
runs it on threads; tests run it directly, for one rank or a thousand."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.runtime.cluster.bounded import KeyValueStore, Stopped

log = logging.getLogger("lightning_incremental")

EXIT_PEER_DEAD = 86

EXIT_PEER_HUNG = 87

EXIT_ISOLATED = 88

COORDINATOR = 0  # the rank whose monitor reads every heartbeat and publishes the verdict

VERDICT = "verdict"  # the coordinator's record, under the watchdog's prefix


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
    reporter: int | None = None  # the rank that found it, when not this one (the coordinator)

    def to_record(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "seconds": self.seconds, "step": self.step}

    @classmethod
    def from_record(cls, record: dict[str, Any], reporter: int) -> Failure:
        kind = record.get("kind")
        return cls(
            kind if kind in ("dead", "hung", "isolated") else "dead",
            int(record.get("rank", -1)),
            float(record.get("seconds", 0.0)),
            record.get("step") if isinstance(record.get("step"), int) else None,
            reporter,
        )

    @property
    def exit_code(self) -> int:
        return {"dead": EXIT_PEER_DEAD, "hung": EXIT_PEER_HUNG}.get(self.kind, EXIT_ISOLATED)

    def describe(self) -> str:
        what = {
            "dead": "sent no heartbeat",
            "hung": "made no training progress",
            "isolated": "could not reach the coordination store",
        }[self.kind]
        found = "" if self.reporter is None else f", as rank {self.reporter} found"
        return f"rank {self.rank} {what} for {self.seconds:.1f}s (last step {self.step}){found}"


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


def setter(key: str, value: str) -> Callable[[KeyValueStore], None]:
    """A store call that writes ``value`` under ``key`` (bound now, whenever a lane runs it)."""
    return lambda client: client.set(key, value)


def _read_verdict(client: KeyValueStore, key: str) -> dict[str, Any] | None:
    return json.loads(client.get(key)) if client.check([key]) else None


Call = Callable[[Callable[[KeyValueStore], Any], float], Any]  # (fn(client), timeout) -> result


class Monitor:
    """One rank's judgement, one interval at a time, over calls bounded by a deadline (no
    threads of its own: :class:`Watchdog` drives it, tests drive it with a counting store).

    The coordinator (rank 0) reads every rank's heartbeat, judges (:class:`PeerTracker`) and
    publishes a small verdict record; every other rank reads only that record. Each read is a
    round trip that must complete before the isolation deadline — ``heartbeat_timeout`` after
    the last one that did: a rank that cannot complete it is *isolated*. A verdict that stops
    changing is the coordinator's silence: it is dead. Per interval the store serves N
    heartbeat writes, one read of N records and N - 1 reads of one record: O(N).
    """

    def __init__(
        self, rank: int, world_size: int, config: WatchdogConfig, prefix: str, started: float
    ) -> None:
        self.rank, self.world_size, self.config, self.prefix = rank, world_size, config, prefix
        self.started = self.last_ok = started
        self.tracker = PeerTracker(world_size, config, started=started)
        self.seq = 0  # verdicts published (coordinator)
        self.verdict_seq, self.verdict_since = -1, started  # the coordinator's, as seen
        self.coordinator_stopped = False
        self.step_seen: int | None = None

    @property
    def verdict_key(self) -> str:
        return f"{self.prefix}/{VERDICT}"

    def step(self, call: Call, clock: Callable[[], float]) -> Failure | None:
        """Read (and, on the coordinator, judge and publish) once; the failure found, if any.

        Raises:
            Stopped: the caller was told to stop meanwhile.
        """
        budget = self.last_ok + self.config.heartbeat_timeout - clock()
        try:
            if self.rank == COORDINATOR:
                return self._coordinate(call, budget, clock)
            return self._follow(call, budget, clock)
        except Stopped:
            raise
        except Exception as exc:  # the round trip did not complete
            cut_off = clock() - self.last_ok
            log.warning(
                "rank %d could not read the coordination store (no round trip for %.1fs): %s",
                self.rank,
                cut_off,
                exc,
            )
            if cut_off >= self.config.heartbeat_timeout:
                return Failure("isolated", self.rank, cut_off, self.step_seen)
            return None

    def _coordinate(self, call: Call, budget: float, clock: Callable[[], float]) -> Failure | None:
        keys = [f"{self.prefix}/{rank}" for rank in range(self.world_size)]
        records = call(lambda client: _read_records(client, keys), budget)
        now = self.last_ok = clock()
        for rank, record in enumerate(records):
            self.tracker.observe(rank, record, now)
        failure = self.tracker.judge(now)
        self.seq += 1
        verdict = {"seq": self.seq, "failure": failure.to_record() if failure else None}
        try:  # a write expects no answer: it is no evidence either way
            call(setter(self.verdict_key, json.dumps(verdict)), budget)
        except Stopped:
            raise
        except Exception as exc:
            log.warning("rank %d could not publish the verdict: %s", self.rank, exc)
        return failure

    def _follow(self, call: Call, budget: float, clock: Callable[[], float]) -> Failure | None:
        verdict = call(lambda client: _read_verdict(client, self.verdict_key), budget)
        now = self.last_ok = clock()
        if verdict is None:  # the coordinator has published nothing yet
            silent = now - self.started
            if silent > self.config.heartbeat_timeout:
                return Failure("dead", COORDINATOR, silent, None)
            return None
        if verdict.get("stopped") is True:  # it finished: nobody judges heartbeats any more
            self.coordinator_stopped = True
            return None
        seq = verdict.get("seq")
        if seq != self.verdict_seq:
            self.verdict_seq, self.verdict_since = seq, now
        found = verdict.get("failure")
        if isinstance(found, dict):
            failure = Failure.from_record(found, reporter=COORDINATOR)
            if failure.rank == self.rank and failure.kind == "dead":
                # This rank reads the store, but its heartbeats do not reach the coordinator:
                # to the group it is cut off.
                return Failure("isolated", self.rank, failure.seconds, failure.step, COORDINATOR)
            return failure
        silent = now - self.verdict_since
        if silent > self.config.heartbeat_timeout:
            return Failure("dead", COORDINATOR, silent, None)
        return None
