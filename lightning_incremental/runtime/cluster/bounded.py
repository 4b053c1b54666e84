"""Store calls that return by a deadline, whatever the network does.

A ``torch.distributed`` TCPStore client does not bound its calls by its ``timeout`` when the link
to the server is cut but the connection stays open (a dead switch port, a half-open connection):
``set`` returns at once (it expects no reply), while ``check``, ``get``, ``multi_get`` and a new
connection block until the link heals. A thread of ours that called one would block with it,
and so would whoever joins that thread.

So every call runs on a *lane*: a daemon thread that owns its own client. The caller waits for
the result until its deadline (or until it is told to stop) and then gives up on the lane: the
lane's thread stays blocked in the call until the link heals or the socket fails, then ends;
the next call starts a fresh lane with a fresh connection. Why this is safe:

- an abandoned lane touches nothing but its own client (never the process group's store, never
  another thread's), and its late result is dropped;
- its thread is a daemon thread that nobody joins: it cannot hold up a shutdown or the exit;
- what a late call does is harmless: a heartbeat or verdict record written late is as true as a
  record can be once it lands, and every reader judges records by their sequence numbers;
- lanes still blocked are bounded (:data:`MAX_STUCK`): while that many are stuck, calls fail at
  once instead of piling up threads and connections during a long cut.

There is no socket-level alternative: the TCPStore client's socket is not exposed, and its
``timeout`` bounds waits for keys, not a silent link.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("lightning_incremental")

T = TypeVar("T")
MAX_STUCK = 2  # lanes that may be blocked in a call at once before calls fail straight away
POLL_S = 0.02  # how often a waiting caller looks at its stop event


class KeyValueStore(Protocol):
    """What the watchdog needs of a ``torch.distributed.Store``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class StoreTimeout(TimeoutError):
    """A store call did not complete by its deadline (the link is cut, or the server is gone)."""


class Stopped(Exception):
    """The caller was told to stop while a store call was in flight."""


class _Job(Generic[T]):
    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class _Lane:
    """One daemon thread and its own client; runs calls one at a time."""

    def __init__(self, connect: Callable[[], Any], name: str) -> None:
        self.connect = connect
        self.client: Any = None
        self.jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self.busy_since: float | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if self.client is None:
                    self.client = self.connect()
                job.result = job.fn(self.client)
            except BaseException as exc:  # handed to the caller, who may have given up
                job.error = exc
                self.client = None  # a failed client is not reused
            finally:
                self.busy_since = None
                job.done.set()

    def submit(self, job: _Job[Any]) -> None:
        self.busy_since = time.monotonic()
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)  # ends the thread once its current call (if any) returns


class BoundedStore:
    """Calls into a store (a fresh client from ``connect`` per lane), each bounded by a deadline.

    Args:
        connect: returns a new client (called on the lane's own thread).
        name: names the lanes' threads.
        stop: a caller waiting for a call gives up at once when this is set (unless it asks to
            be left uninterrupted).
    """

    def __init__(
        self, connect: Callable[[], Any], name: str, stop: threading.Event | None = None
    ) -> None:
        self.connect, self.name = connect, name
        self.stop = stop or threading.Event()
        self._lane: _Lane | None = None
        self._stuck: list[_Lane] = []
        self._count = 0

    def call(self, fn: Callable[[Any], T], timeout: float, *, interruptible: bool = True) -> T:
        """``fn(client)``, or :class:`StoreTimeout` once ``timeout`` seconds have passed.

        Raises:
            StoreTimeout: not done in time (the lane is abandoned), or too many lanes stuck.
            Stopped: ``stop`` was set meanwhile (``interruptible``).
            Exception: whatever ``fn`` or ``connect`` raised.
        """
        self._stuck = [lane for lane in self._stuck if lane.busy_since is not None]
        if len(self._stuck) >= MAX_STUCK:
            since = min(lane.busy_since or 0.0 for lane in self._stuck)
            raise StoreTimeout(
                f"{len(self._stuck)} earlier store calls are still blocked (for "
                f"{time.monotonic() - since:.1f}s): the store is unreachable"
            )
        if self._lane is None:
            self._count += 1
            self._lane = _Lane(self.connect, f"{self.name}-{self._count}")
        lane, job = self._lane, _Job(fn)
        lane.submit(job)
        deadline = time.monotonic() + max(timeout, 0.0)
        while not job.done.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
            stopped = interruptible and self.stop.is_set()
            if stopped or time.monotonic() >= deadline:
                self._abandon(lane)
                if stopped:
                    raise Stopped("stopped while a store call was in flight")
                raise StoreTimeout(f"a store call did not complete within {timeout:.1f}s")
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _abandon(self, lane: _Lane) -> None:
        lane.close()
        self._lane = None
        self._stuck.append(lane)

    def close(self) -> None:
        """End the current lane (its thread ends once idle); stuck lanes end when unblocked."""
        if self._lane is not None:
            self._lane.close()
            self._lane = None
