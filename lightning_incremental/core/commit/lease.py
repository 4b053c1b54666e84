"""The writer lease: one writing process per store, enforced.

A process that writes to a store (saves, compacts, deletes, collects without a grace period,
claims a generation) first takes the store's lease: a small JSON record under ``lease/``,
written create-only, naming the holder::

    lease/<sequence:010d>.json  {"format", "owner", "host", "boot", "pidns", "pid", "job",
                                 "requeue", "generation", "acquired", "heartbeat", "ttl_s",
                                 "released"}

The record with the highest sequence number is the lease. The holder renews ``heartbeat``
(seconds since the epoch) every ``ttl_s / 4`` seconds from a daemon thread and checks, before
every commit, that its record is still the newest. Another process may take the lease over
only by writing the *next* sequence number, create-only (so of two processes racing for it,
one wins), and only when the current record:

- was released (its holder closed the store);
- is stale: its heartbeat is older than its ``ttl_s``, or its holder runs on this host (same
  host name, boot id and pid namespace: the host name alone is not unique, and a pid namespace
  inode is the same constant on every Linux host) and that process no longer exists;
- belongs to an older fencing generation of the same job: a restarted job (it claimed a newer
  generation, see :mod:`~lightning_incremental.core.commit.fencing`) takes over from its own
  previous incarnation at once. The job is known by the launcher's id (:func:`job_id`); a
  takeover by generation needs both ids known and equal, so a second, independent job is
  refused however new a generation it claims. Under SLURM the id holds the job step: a second
  step of one allocation is another job. A requeued SLURM job (``requeue``: its job id and
  ``SLURM_RESTART_COUNT``, :func:`job_requeue`) takes over from an earlier run of itself,
  whichever step that was: SLURM requeues a job only after every process of it ended; an
  earlier run never takes over from a later one.

Taking over a record that was not released reports a :class:`Takeover`: the new holder then
claims a new fencing generation before its first commit (:meth:`.fencing.Generation.admit`),
so whatever the old holder (frozen, partitioned, suspended) commits late is invisible, and its
commit raises :class:`~lightning_incremental.core.errors.FencedError`.

Otherwise the second writer gets :class:`~lightning_incremental.core.errors.WriterLeaseError`
naming the holder. A holder that finds its record superseded stops committing (the same error).

Every store object of one process on one location shares the process's lease: a maintenance
store beside the training store in the same process is the same writer. Readers (``load``,
``verify``, ``steps``), and ``gc`` with a grace period, take no lease.

Staleness compares the holder's wall clock with the reader's: hosts whose clocks disagree by
more than ``ttl_s`` see each other's leases as stale. On a backend without an atomic
create-only write the sequence race narrows but does not close (as for fencing).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.commit.owner import (
    boot_id,
    job_id,
    job_requeue,
    pid_namespace,
    process_exists,
    same_machine,
)
from lightning_incremental.core.errors import WriterLeaseError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")

LEASE_DIR = "lease"
RELEASE_JOIN_S = 30.0  # how long a release waits for the heartbeat thread to end
_NAME = re.compile(r"^(\d{10,})\.json$")
_MAX_RECORD = 1 << 16


def _run_of_this_job(held: Any) -> int | None:
    """How the run of the holder's ``requeue`` record (:func:`job_requeue`) compares with this
    one's when both are runs of one SLURM job: negative for an earlier run, 0 for this run,
    positive for a later one (this process is then a stale run); None otherwise."""
    mine = job_requeue()
    if mine is None or not isinstance(held, list) or len(held) != 2:
        return None
    job, count = held
    if job != mine[0] or isinstance(count, bool) or not isinstance(count, int):
        return None
    return count - mine[1]


def lease_path(sequence: int) -> str:
    return f"{LEASE_DIR}/{sequence:010d}.json"


@dataclass(frozen=True)
class Takeover:
    """This process took over a lease its holder had not released (stale, dead, or an older
    generation of this job): that holder may still be alive and commit late.

    Attributes:
        generation: the generation the old record named (None: it named none).
        holder: the old record, described.
    """

    generation: int | None
    holder: str


@dataclass(frozen=True)
class Record:
    """One lease record, parsed."""

    sequence: int
    doc: dict[str, Any]

    @property
    def owner(self) -> str:
        return str(self.doc.get("owner"))

    def describe(self) -> str:
        d = self.doc
        beat = d.get("heartbeat")
        age = f"{time.time() - beat:.0f}s ago" if isinstance(beat, (int, float)) else "never"
        return (
            f"host {d.get('host')} pid {d.get('pid')} (generation {d.get('generation')}, "
            f"job {d.get('job') or 'unknown'}, acquired {d.get('acquired')}, last heartbeat {age})"
        )


def newest(storage: Storage) -> Record | None:
    """The current lease record (highest sequence); None when there is none. A record that
    cannot be parsed (torn by a crash) counts as released: it names no live holder."""
    found = []
    for path in storage.list(LEASE_DIR):
        match = _NAME.match(path.rsplit("/", 1)[-1])
        if match and path.count("/") == 1:
            found.append(int(match.group(1)))
    if not found:
        return None
    sequence = max(found)
    try:
        data = storage.get(lease_path(sequence))
    except FileNotFoundError:
        return Record(sequence, {"released": True, "note": "vanished"})
    try:
        if len(data) > _MAX_RECORD:
            raise ValueError("too large")
        doc = mf.loads_record(data)
        if not isinstance(doc, dict) or doc.get("format") != mf.FORMAT:
            raise ValueError("not a lease record")
    except ValueError:
        log.warning(
            "lease record %s of %s is unreadable; treating it as released",
            lease_path(sequence),
            storage.url,
        )
        return Record(sequence, {"released": True, "note": "unreadable"})
    return Record(sequence, doc)


class _Held:
    """This process's lease on one location, shared by every store object there."""

    def __init__(self, storage: Storage, ttl_s: float, clock: Callable[[], float]) -> None:
        self.storage, self.ttl_s, self.clock = storage, ttl_s, clock
        self.owner = uuid.uuid4().hex
        self.pid = os.getpid()
        self.sequence: int | None = None
        self.generation = 0
        self.users = 0
        self.acquired = ""
        self.lost: str | None = None  # why the lease was lost, once it was
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def body(self, released: bool = False) -> bytes:
        doc = {
            "format": mf.FORMAT,
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": self.pid,
            "boot": boot_id(),
            "pidns": pid_namespace(),
            "job": job_id(),
            "requeue": job_requeue(),
            "generation": self.generation,
            "acquired": self.acquired,
            "heartbeat": self.clock(),
            "ttl_s": self.ttl_s,
            "released": released,
        }
        return json.dumps(doc, sort_keys=True).encode()

    # -------------------------------------------------------------- taking

    def acquire(
        self, generation: int, claiming: bool, before_takeover: Callable[[], None] | None
    ) -> Takeover | None:
        with self.lock:
            if self.sequence is not None and self.lost is None:
                if generation > self.generation or claiming:
                    self.check()  # before recording the newer generation in our record
                    self.generation = max(self.generation, generation)
                    self._write(overwrite=True)
                return None  # held: the heartbeat and the check before each commit watch it
            if self.lost is not None and not claiming:
                self.check()
            self.generation = max(self.generation, generation)
            while True:
                current = newest(self.storage)
                taking = current is not None and _unreleased(current, self.owner)
                if current is not None:
                    self._may_take(current, generation, claiming)
                    if taking and before_takeover is not None:
                        before_takeover()  # what was there before this process took over
                sequence = 0 if current is None else current.sequence + 1
                self.sequence, self.lost = sequence, None
                self.acquired = datetime.datetime.now(datetime.timezone.utc).isoformat()
                data = self.body()
                if self.storage.put(lease_path(sequence), data) and self._reads_back(
                    sequence, data
                ):
                    break
                self.sequence = None  # another process took this number first: look again
            takeover = None
            if current is not None and taking:
                log.warning(
                    "took over the writer lease of %s from %s", self.storage.url, current.describe()
                )
                held = current.doc.get("generation")
                takeover = Takeover(
                    held if isinstance(held, int) and not isinstance(held, bool) else None,
                    current.describe(),
                )
            for old in range(max(0, sequence - 8), sequence):
                self.storage.delete(lease_path(old))  # keep the directory small
            self._start()
            return takeover

    def _reads_back(self, sequence: int, data: bytes) -> bool:
        """Whether our record at ``sequence`` is still there as written (a racing writer may
        have replaced it, on a backend without atomic create-only writes, or a newer holder
        already removed it with the other old records)."""
        try:
            return self.storage.get(lease_path(sequence)) == data
        except FileNotFoundError:
            return False

    def _may_take(self, current: Record, generation: int, claiming: bool) -> None:
        doc = current.doc
        if not _unreleased(current, self.owner):
            return
        now = self.clock()
        beat, ttl = doc.get("heartbeat"), doc.get("ttl_s")
        if not isinstance(beat, (int, float)) or not isinstance(ttl, (int, float)):
            return  # malformed: names no live holder
        if now - beat > ttl:
            return
        if same_machine(doc):
            pid = doc.get("pid")
            if pid == os.getpid() and not _live_here(current.owner):
                return  # this process wrote it, but none of its stores holds it any more
            if isinstance(pid, int) and pid != os.getpid() and not process_exists(pid):
                return
        theirs, mine = doc.get("job"), job_id()
        same_job = theirs is not None and mine is not None and theirs == mine
        held_generation = doc.get("generation")
        run = _run_of_this_job(doc.get("requeue"))
        if (
            ((same_job and (run is None or run <= 0)) or (run is not None and run < 0))
            and isinstance(held_generation, int)
            and (claiming or generation > held_generation)
        ):
            return
        unknown = (
            " A restarted job takes over by generation only when both jobs are known by the "
            "same launcher id (torchrun's run id, the SLURM job and step ids) or it is a "
            f"requeued SLURM job; this one is {mine or 'unknown'}, the holder's "
            f"{theirs or 'unknown'}."
            if claiming or generation > 0
            else ""
        )
        raise WriterLeaseError(
            f"{self.storage.url} is being written by another process: {current.describe()}. "
            "One writer per store: wait for that writer to finish (or stop it), or save to "
            "another location (another dirpath). If it is gone, a new writer takes the store "
            f"over {ttl:.0f}s after its last heartbeat (on its host: once its process ended), "
            f"or delete {lease_path(current.sequence)} once you are sure. Reading, verify and "
            f"gc with a grace period need no lease.{unknown}"
        )

    # -------------------------------------------------------------- holding

    def check(self) -> None:
        """Raise WriterLeaseError unless this process still holds the lease."""
        with self.lock:
            if self.lost is None:
                current = newest(self.storage)
                if current is None or current.owner != self.owner or current.doc.get("released"):
                    self._lose(current)
            if self.lost is not None:
                raise WriterLeaseError(
                    f"this process lost the writer lease of {self.storage.url}: {self.lost}; it "
                    "must stop writing (what it would commit could interleave with the other "
                    "writer's history)"
                )

    def _lose(self, current: Record | None) -> None:
        self.lost = (
            f"taken over by {current.describe()}"
            if current is not None and current.owner != self.owner
            else "its lease record was removed or released"
        )
        self.sequence = None
        self._stop.set()
        log.error("lost the writer lease of %s: %s", self.storage.url, self.lost)

    def _write(self, *, overwrite: bool) -> None:
        assert self.sequence is not None
        self.storage.put(lease_path(self.sequence), self.body(), overwrite=overwrite)

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_heartbeat, args=(self, self._stop), name="li-lease", daemon=True
        )
        self._thread.start()

    def beat(self) -> None:
        """Renew the heartbeat, unless the lease was taken over (then stop)."""
        with self.lock:
            if self.sequence is None or self.lost is not None:
                return
            current = newest(self.storage)
            if current is None or current.owner != self.owner:
                self._lose(current)
                return
            self._write(overwrite=True)

    def release(self) -> None:
        self._release()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # The heartbeat ends with its lease: no thread outlives the store — unless its
            # storage call is stuck (a hung mount), which must not hang the shutdown too.
            thread.join(RELEASE_JOIN_S)
            if thread.is_alive():
                log.warning(
                    "the writer lease heartbeat of %s is stuck in a storage call; not waiting "
                    "for it (a daemon thread, it ends with the process)",
                    self.storage.url,
                )

    def _release(self) -> None:
        with self.lock:
            self._stop.set()
            if self.sequence is None or self.lost is not None or os.getpid() != self.pid:
                return
            try:
                current = newest(self.storage)
                if current is not None and current.owner == self.owner:
                    self.storage.put(
                        lease_path(self.sequence), self.body(released=True), overwrite=True
                    )
            except Exception as exc:  # the lease then expires by its heartbeat; say so
                log.warning(
                    "could not release the writer lease of %s (it expires after %.0fs): %s",
                    self.storage.url,
                    self.ttl_s,
                    exc,
                )
            self.sequence = None


def _heartbeat(held: _Held, stop: threading.Event) -> None:
    while not stop.wait(held.ttl_s / 4):
        try:
            _release_dropped()
            held.beat()
        except Exception as exc:  # a full disk or an outage: retried at the next beat
            log.warning("writer lease heartbeat of %s failed (retrying): %s", held.storage.url, exc)


def _unreleased(record: Record, owner: str) -> bool:
    """Whether ``record`` names a holder other than ``owner`` that did not release it."""
    return not record.doc.get("released") and record.owner != owner


_REGISTRY: dict[str, _Held] = {}
_REGISTRY_LOCK = threading.Lock()
# Leases of stores dropped (garbage-collected) while the registry was busy: released by the next
# acquire or release in this process, by a lease heartbeat, or at exit. list.append and pop
# need no lock.
_DROPPED: list[Lease] = []


def _release_dropped() -> None:
    """Release the leases whose stores were dropped while the registry was busy. Never called
    with the registry lock held."""
    while _DROPPED:
        try:
            lease = _DROPPED.pop()
        except IndexError:  # another thread took the last one
            return
        lease.release()


atexit.register(_release_dropped)  # after weakref.finalize's exit hook (registered later)


def _live_here(owner: str) -> bool:
    with _REGISTRY_LOCK:
        return any(h.owner == owner and h.sequence is not None for h in _REGISTRY.values())


class Lease:
    """A store object's handle on its process's lease of the store's location."""

    def __init__(
        self, storage: Storage, ttl_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.storage, self.ttl_s, self.clock = storage, ttl_s, clock
        self._held: _Held | None = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(
        self,
        generation: int,
        *,
        claiming: bool = False,
        before_takeover: Callable[[], None] | None = None,
    ) -> Takeover | None:
        """Take (or confirm) the lease for a write. Returns a :class:`Takeover` when this call
        took it over from a holder that had not released it (``before_takeover`` is called
        just before this process's record is written then), else None.

        Raises:
            WriterLeaseError: another process holds it, or this one lost it.
        """
        _release_dropped()
        held = self._held
        if held is None:
            with _REGISTRY_LOCK:
                held = _REGISTRY.get(self.storage.url)
                if held is None or held.pid != os.getpid():
                    held = _REGISTRY[self.storage.url] = _Held(self.storage, self.ttl_s, self.clock)
                held.users += 1
            self._held = held
        return held.acquire(generation, claiming, before_takeover)

    def check(self) -> None:
        """Raise WriterLeaseError unless this process still holds the lease."""
        if self._held is not None:
            self._held.check()

    def release(self) -> None:
        """This store object is done writing; the lease goes when no store of this process
        on the location still uses it."""
        self._release(blocking=True)
        _release_dropped()

    def dropped(self) -> None:
        """:meth:`release` for a store dropped without ``close`` (its finalizer). Garbage
        collection runs it on whatever thread allocates, possibly one inside :meth:`acquire`
        holding the registry lock: it never waits for that lock — when the registry is busy the
        release is deferred to the next acquire or release in this process, a lease heartbeat
        (within a quarter of the TTL) or the exit."""
        if not self._release(blocking=False):
            _DROPPED.append(self)

    def _release(self, *, blocking: bool) -> bool:
        """Leave the registry (and release the lease when this was its last user); False when
        not ``blocking`` and the registry is busy (nothing done)."""
        held = self._held
        if held is None:
            return True
        if not _REGISTRY_LOCK.acquire(blocking=blocking):
            return False
        try:
            self._held = None
            held.users -= 1
            last = held.users <= 0
            if last and _REGISTRY.get(self.storage.url) is held:
                del _REGISTRY[self.storage.url]
        finally:
            _REGISTRY_LOCK.release()
        if last:
            held.release()
        return True
