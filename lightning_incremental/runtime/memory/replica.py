"""Moving memory parts between nodes over the job's own ``torch.distributed``: a gloo group on
host buffers (no server of our own).

- :func:`exchange`: the sends and receives of one round, in two phases (sizes, then bytes), all
  posted at once so that no order of ranks can deadlock;
- :class:`Replicator`: the per-step background work of a rank — finish its part in its node's
  memory, send it to the same local rank on the next ``replicas`` nodes of the ring (and keep
  what the previous nodes send, received straight into files of the node's memory), then agree
  (one all-reduce) whether every rank's part of the step is now held by ``replicas + 1`` nodes
  (fewer when the job has fewer nodes): only then is the step *recoverable*, and older parts go
  (this process's become the files of the next steps). The agreement runs in every topology —
  one node, ``replicas=0`` — for the ranks' parts are written at different speeds (under DDP a
  node's first rank writes the whole state, the others their own state alone): a rank that
  pruned on its own part's word would delete the last step every rank holds while another
  rank's part of the newer one is still being written. A single process needs no agreement.
  A failed transfer is a warning; replication and agreement stop for the rest of the run (the
  ranks may disagree on where the exchange broke), no later step becomes recoverable (the
  last one stays), and recovery falls back to the store once the tier's steps are too old.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.format.layout import loads_record
from lightning_incremental.runtime.memory.agree import Plan
from lightning_incremental.runtime.memory.tier import MemoryTier, Part, Snapshot

log = logging.getLogger(__name__)

_META, _DATA = 1, 2  # message tags within one exchange


def ring(
    rank: int, world_size: int, ranks_per_node: int, replicas: int
) -> tuple[list[int], list[int]]:
    """Where ``rank`` sends its part and whose parts it keeps: the same local rank on the next
    (previous) ``replicas`` nodes, fewer when the job has fewer other nodes."""
    nodes = max(1, world_size // max(1, ranks_per_node))
    copies = min(replicas, nodes - 1)
    step = ranks_per_node
    dsts = [(rank + step * k) % world_size for k in range(1, copies + 1)]
    srcs = [(rank - step * k) % world_size for k in range(1, copies + 1)]
    return dsts, srcs


def exchange(
    sends: Mapping[int, Part | None],
    receives: Sequence[int],
    group: Any,
    into: Callable[[int, int], torch.Tensor | None] | None = None,
) -> dict[int, Part | None]:
    """Send each ``sends[dst]`` (None: nothing to send) and receive from each rank in
    ``receives`` (global ranks); every rank of the round calls it. ``into(src, nbytes)`` may
    give the memory to receive ``src``'s data into (else a new host buffer). Raises what the
    collective raises (a timeout, a dead peer)."""
    dist = torch.distributed
    sizes = {src: torch.zeros(3, dtype=torch.int64) for src in receives}
    works = []
    outgoing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for dst, part in sends.items():
        if part is None:
            length = torch.zeros(3, dtype=torch.int64)
        else:
            meta = torch.frombuffer(bytearray(part.header + part.index), dtype=torch.uint8)
            outgoing[dst] = (meta, part.data)
            length = torch.tensor([len(part.header), len(part.index), part.data.numel()])
        works.append(dist.isend(length, dst=dst, group=group, tag=0))
    works += [dist.irecv(sizes[src], src=src, group=group, tag=0) for src in receives]
    for work in works:
        work.wait()
    works = []
    incoming: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
    for src, size in sizes.items():
        head, index, data = (int(x) for x in size)
        if head == 0:
            continue
        meta = torch.empty(head + index, dtype=torch.uint8)
        buf = into(src, data) if into is not None else None
        if buf is None:
            buf = torch.empty(data, dtype=torch.uint8)
        incoming[src] = (meta, buf, head)
        works.append(dist.irecv(meta, src=src, group=group, tag=_META))
        if data:
            works.append(dist.irecv(buf, src=src, group=group, tag=_DATA))
    for dst, (meta, data) in outgoing.items():
        works.append(dist.isend(meta, dst=dst, group=group, tag=_META))
        if data.numel():
            works.append(dist.isend(data, dst=dst, group=group, tag=_DATA))
    for work in works:
        work.wait()
    received: dict[int, Part | None] = {src: None for src in receives}
    for src, (meta, buf, head) in incoming.items():
        raw = meta.numpy().tobytes()
        received[src] = Part(raw[:head], raw[head:], buf)
    return received


def fetch_plan(plan: Plan, tier: MemoryTier, rank: int, group: Any) -> Part | None:
    """Move the parts ``plan`` says a peer sends: this rank sends what it holds for others and
    receives its own part when its node has none. Returns the part received (else None).
    Every rank calls it (the transfers are collective). Raises what the collective raises, or
    ``MemoryPartError`` when a part this rank must send is unreadable (the receiver then gets
    nothing and says so)."""
    assert plan.step is not None
    sends: dict[int, Part | None] = {}
    error: Exception | None = None
    for owner, source in enumerate(plan.sources):
        if source == rank and owner != rank:
            try:
                sends[owner] = tier.part(owner, plan.step, plan.generation)
            except Exception as exc:  # the receiver learns it from an empty part
                sends[owner], error = None, exc
    source = plan.sources[rank]
    received = exchange(sends, [source] if source != rank else [], group)
    if error is not None:
        raise error
    return received.get(source) if source != rank else None


class GroupLinks:
    """The two collectives of a memory step over the job's side group: the ring's exchange and
    the agreement. (A seam: the tier's property test drives ranks as threads through it.)"""

    def __init__(self, group: Any) -> None:
        self.group = group

    def exchange(
        self,
        sends: Mapping[int, Part | None],
        receives: Sequence[int],
        into: Callable[[int, int], torch.Tensor | None] | None = None,
    ) -> dict[int, Part | None]:
        return exchange(sends, receives, self.group, into)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on every rank (every rank calls it)."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return bool(value.item())


@dataclass
class _Job:
    step: int
    snap: Snapshot


class Replicator:
    """One rank's memory steps: :meth:`submit` hands a snapshot over (waiting for the previous
    step's work first); a named daemon thread writes, replicates, agrees and prunes it.
    ``links`` (None: a single process) carries the transfers and the agreement; every rank of
    the job submits every step, in the same order."""

    def __init__(
        self,
        tier: MemoryTier,
        *,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        replicas: int,
        links: GroupLinks | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        self.tier = tier
        self.pool = pool  # where a written snapshot's buffers go back, for the next one
        self.rank = rank
        self.links = links
        self.dsts, self.srcs = ring(rank, world_size, ranks_per_node, replicas)
        if links is None:
            self.dsts, self.srcs = [], []
        # (step, generation): the newest step whose every part is held (as replicas + 1
        # nodes agreed), or the step this run resumed from
        self.recoverable: tuple[int, int] | None = None
        self.written: int | None = None  # this rank's newest part in its node's memory
        self.agreeing = links is not None  # False once a transfer failed: nothing recoverable
        self._job: _Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="li-memory-tier", daemon=True)
        self._thread.start()

    @property
    def replicating(self) -> bool:
        """Whether this rank's steps are still sent to other nodes."""
        return self.agreeing and bool(self.dsts)

    def submit(self, step: int, snap: Snapshot) -> None:
        """Write and replicate ``snap`` as this rank's part of ``step`` in the background."""
        with self._cond:
            while self._job is not None and not self._closed:
                self._cond.wait()
            if self._closed:
                return
            self._job = _Job(step, snap)
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the submitted step is done; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._job is None or self._closed, timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Finish the step in hand (within ``timeout``) and stop the thread; whether it stopped
        (else it is still inside a transfer, until the group's timeout)."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                job = self._job
            try:
                self._step(job)
            except Exception as exc:  # a bug here must not stop training: say it, stop tier
                warnings.warn(f"memory tier: step {job.step} failed: {exc!r}", stacklevel=1)
                self.agreeing = False
            finally:
                with self._cond:
                    self._job = None
                    self._cond.notify_all()

    def _step(self, job: _Job) -> None:
        step = job.step
        ok = self._write(job)  # never raises: every rank must reach the agreement below
        if ok:
            self.written = step
        # a single process: its own part is every part
        links = self.links
        agreed = ok if links is None else self.agreeing and self._agree(links, step, ok)
        generation = self.tier.generation
        if agreed:
            self.recoverable = (step, generation)
        # the newest step every rank holds, and this rank's newest part: nothing else (an
        # earlier run's parts but the step this run resumed from are of no use)
        keep = {self.recoverable} if self.recoverable is not None else set()
        if self.written is not None:
            keep.add((self.written, generation))
        self.tier.prune([self.rank, *self.srcs], keep)

    def _write(self, job: _Job) -> bool:
        try:
            return self.tier.write(job.snap, self.rank, job.step)
        except Exception as exc:  # not the tier's own failures (those are warned, False): a bug
            warnings.warn(f"memory tier: writing step {job.step} failed: {exc!r}", stacklevel=1)
            return False
        finally:
            if self.pool is not None:  # the host copy is no longer needed: the next step reuses
                if job.snap.slot is not None:  # copied into the part's file: keep what it used
                    self.pool.clear()
                self.pool.give(job.snap.buffers())
            job.snap = Snapshot(None, [])

    def _agree(self, links: GroupLinks, step: int, ok: bool) -> bool:
        """Send this rank's part of ``step`` to the next nodes and keep the previous nodes'
        (when replicating), then whether every rank's part and replicas are held."""
        tier = self.tier
        replicating = bool(self.dsts)
        try:
            if replicating:
                part = tier.part(self.rank, step, tier.generation) if ok else None
                sends = {dst: part for dst in self.dsts}
                try:  # each replica straight into a file of the node's memory
                    received = links.exchange(sends, self.srcs, into=tier.receiver)
                    for src, got in received.items():
                        ok = ok and got is not None and _of(got, src, step) and tier.write_part(got)
                finally:
                    tier.unused_receivers()
            return links.all_true(ok)
        except Exception as exc:  # a dead peer, a timeout: the store remains
            self.agreeing = False
            what = f"agreeing on step {step} with the other ranks"
            if replicating:
                what = f"replicating step {step} to ranks {self.dsts}"

            warnings.warn(
                f"memory tier: {what} failed: {exc}. No later memory step becomes "
                "recoverable in this run (the last one is kept); recovery from a lost "
                "process or node falls back to the persistent store once it is newer.",
                stacklevel=1,
            )
            return False


def _of(part: Part, rank: int, step: int) -> bool:
    try:
        head = loads_record(part.header)
    except ValueError:
        return False
    return isinstance(head, dict) and head.get("rank") == rank and head.get("step") == step
