"""Generation fencing: a writer that the job has moved on from can commit nothing visible.

Every (re)start of a distributed job *claims* a generation number that only grows, by writing a
fence record ``fences/<generation>.json`` create-only. The record lists the steps that were
visible when it was written. From then on, the visibility rule is, for the newest fence ``F``:

    a manifest is visible  ⇔  its step is in ``F.accepted``  or  its generation ≥ ``F.generation``

so a manifest written by an older generation *after* the claim — a frozen rank that woke up, a
partitioned node that kept training — is never visible, however late it lands. The rule is
enforced by what is in storage, not by timing: there is no window in which a check passes and
a stale write then sneaks in, because the check happens on every read. Writers also check before
and after their commit so that they learn they were fenced off (:class:`FencedError`), and a new
generation that finds a fenced-off manifest at a step it wants moves it to quarantine.

A compaction never replaces a manifest: it writes the step's full base under a name of its own,
``manifests/<step>.c<generation>.json`` (:mod:`~lightning_incremental.core.commit.versions`),
visible by the same rule — its generation is in the name, so a compactor that a newer generation
took over from (frozen between its checks and its write) lands a manifest that is never visible,
while the step's commit it meant to replace stays as it was. A claim records, for every step it
accepts, the compaction visible at that moment (``"compacted"``), so a compaction that was
visible stays visible under every later fence. Only once its compaction is known visible does a
writer remove the versions it supersedes.

Create-only writes (local link, S3 ``If-None-Match``) make two claimants of the same number
impossible: the loser takes the next number. On a backend without an atomic create-only write
(an S3 endpoint without conditional writes, some fsspec filesystems) the claimant reads its record
back, which narrows the race but cannot close it: there, fencing is best effort. Stores that
never claim join the newest generation, fixed when they first write; before any claim that is
generation 0, so every claim is at least 1 (a writer that joined before the first claim, then
froze, is fenced off by it like any other).

A damaged newest fence record (e.g. truncated by a crash with ``fsync=False``) stops every read
with an error naming it; deleting that file restores the previous generation's rule.

A process can also fence *itself* (:func:`fence_process`): the runtime's watchdog does so when it
finds this rank isolated or the group failing, before the process exits. From then on no store of
the process commits or deletes (a save already queued on its saver thread included), whatever
the fence records say.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_incremental.core.commit.owner import job_requeue
from lightning_incremental.core.commit.versions import Version, Versions
from lightning_incremental.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedError,
    FormatVersionError,
    ManifestError,
)
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import Storage

if TYPE_CHECKING:
    from lightning_incremental.core.commit.history import History
    from lightning_incremental.core.commit.lease import Lease, Takeover
    from lightning_incremental.core.format.records import Manifest

log = logging.getLogger("lightning_incremental")

FENCE_DIR = "fences"
_PROCESS_FENCE: list[str] = []  # why this process may no longer commit (set once, kept)
_NAME = re.compile(r"^(\d{10,})\.json$")  # zero-padded to 10 digits, longer when larger
_MAX_ACCEPTED = 10_000_000


@dataclass(frozen=True)
class Fence:
    """The newest claim: its generation, the steps visible when it was made, and for those of
    them that a compaction had rewritten, the compaction's generation."""

    generation: int
    accepted: frozenset[int]
    record: dict[str, Any]
    compacted: Mapping[int, int] = field(default_factory=dict)

    def admits(self, step: int, generation: int | None) -> bool:
        """Whether a manifest of ``step`` written by ``generation`` is visible under this fence
        (``generation`` None: unknown, e.g. unreadable)."""
        if step in self.accepted:
            return True
        return generation is not None and generation >= self.generation

    def admits_compaction(self, step: int, generation: int) -> bool:
        """Whether the full base of ``step`` that a writer of ``generation`` rewrote it as is
        visible: written by this fence's generation or a newer one, or visible when it was
        claimed."""
        return generation >= self.generation or self.compacted.get(step) == generation

    def describe(self) -> str:
        who = self.record.get("host"), self.record.get("pid"), self.record.get("created")
        return f"generation {self.generation} (claimed by host {who[0]} pid {who[1]} at {who[2]})"


def fence_process(reason: str) -> None:
    """Fence off this process: no store of it commits or deletes from now on (each raises
    :class:`FencedError` naming ``reason``). Kept until the process ends."""
    if not _PROCESS_FENCE:
        _PROCESS_FENCE.append(reason)
        log.error("this process is fenced off (%s): it commits and deletes nothing more", reason)


def process_fence() -> str | None:
    """Why this process was fenced off (:func:`fence_process`), or None."""
    return _PROCESS_FENCE[0] if _PROCESS_FENCE else None


def check_process(what: str) -> None:
    """Raise :class:`FencedError` (``what`` happened, and why) when this process was fenced
    off (:func:`fence_process`)."""
    reason = process_fence()
    if reason is not None:
        raise FencedError(
            f"{what}: this process was fenced off ({reason}); the job restarts without it"
        )


def should_claim(world_size: int) -> bool:
    """Whether a job's (re)start claims a generation: when it has several processes, runs
    under torchrun (which may restart it), or is a requeued SLURM job (it takes over from its
    earlier run, see :mod:`.lease`, which may have left its lease unreleased on another node)."""
    requeue = job_requeue()
    return world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ or bool(requeue and requeue[1])


def restart_count() -> int:
    """The elastic launcher's restart count (0 outside torchrun): the least generation a
    restarted job may claim."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(restarts) if restarts.isdigit() else 0


def fence_path(generation: int) -> str:
    return f"{FENCE_DIR}/{generation:010d}.json"


def generations(storage: Storage) -> list[int]:
    """Every claimed generation, oldest first."""
    found = []
    for path in storage.list(FENCE_DIR):
        match = _NAME.match(path.rsplit("/", 1)[-1])
        if match and path.count("/") == 1:
            found.append(int(match.group(1)))
    return sorted(found)


def newest(storage: Storage) -> Fence | None:
    """The newest fence, validated; None when no generation was ever claimed.

    Raises:
        ManifestError: the newest fence record is malformed (never guessed around: a fence that
            cannot be read would make stale checkpoints visible).
    """
    claimed = generations(storage)
    if not claimed:
        return None
    generation = claimed[-1]
    where = f"fence record {fence_path(generation)} of {storage.url}"
    try:
        data = storage.get(fence_path(generation))
    except FileNotFoundError as exc:  # deleted between the listing and the read
        raise ManifestError(f"{where} vanished while being read") from exc
    try:
        return parse(data, generation, where)
    except ManifestError as exc:
        raise ManifestError(
            f"{exc}; if it is damaged, delete it to fall back to the previous generation's fence"
        ) from exc


def parse(data: bytes, generation: int, where: str) -> Fence:
    """A fence record's bytes, validated (plain JSON only; bounded)."""
    if len(data) > 16 * _MAX_ACCEPTED:
        raise ManifestError(f"{where} is too large ({len(data)} bytes)")
    try:
        doc = mf.loads_record(data.decode("utf-8"))
    except ValueError as exc:
        raise ManifestError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != mf.FORMAT:
        raise ManifestError(f"{where} is not a fence record of this library")
    accepted = doc.get("accepted")
    if doc.get("generation") != generation or not isinstance(accepted, list):
        raise ManifestError(f"{where} does not record generation {generation} and its steps")
    if len(accepted) > _MAX_ACCEPTED or not all(_natural(s) for s in accepted):
        raise ManifestError(f"{where} lists invalid steps")
    pairs = doc.get("compacted", [])
    if (
        not isinstance(pairs, list)
        or len(pairs) > len(accepted)
        or not all(
            isinstance(p, list) and len(p) == 2 and _natural(p[0]) and _natural(p[1]) for p in pairs
        )
    ):
        raise ManifestError(f"{where} lists invalid compactions")
    return Fence(generation, frozenset(accepted), doc, {s: g for s, g in pairs})


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record(generation: int, visible: Mapping[int, Version], minimum: int) -> bytes:
    """A new fence record's bytes, accepting the ``visible`` steps as they are (the compaction
    that is each one's manifest, where one is)."""
    body = {
        "format": mf.FORMAT,
        "generation": generation,
        "accepted": sorted(visible),
        "compacted": sorted([s, v] for s, v in visible.items() if v is not None),
        "requested": minimum,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    return json.dumps(body, sort_keys=True).encode()


ReadManifest = Callable[[int, Version], "Manifest"]


class Fencing:
    """The fencing side of one store: judges which manifests are visible, claims generations,
    and tells a writer when it was fenced off.

    Args:
        storage: the store's storage.
        read_manifest: reads and validates a version of a step's manifest (the store's reader:
            it raises ``CheckpointNotFoundError``, ``CorruptCheckpointError``, ...).
    """

    def __init__(self, storage: Storage, read_manifest: ReadManifest) -> None:
        self.storage = storage
        self._read = read_manifest
        # A manifest's generation, remembered only while it makes the manifest visible: a
        # visible manifest is never replaced by an invisible one, while an invisible one may be
        # displaced by the current generation's checkpoint of the same step.
        self._known: dict[int, int] = {}

    def partition(self, written: Mapping[int, Versions]) -> tuple[dict[int, Version], list[int]]:
        """The steps of ``written`` (one listing of the manifests, by step) split into the
        visible ones, each with the version that is its manifest (the newest visible
        compaction, else the commit's own), and those only fenced-off generations wrote."""
        fence = newest(self.storage)
        visible: dict[int, Version] = {}
        fenced: list[int] = []
        for step in sorted(written):
            versions = written[step]
            shown = [
                g for g in versions.compactions if fence is None or fence.admits_compaction(step, g)
            ]
            if shown:
                visible[step] = shown[-1]
            elif versions.original and (
                fence is None or fence.admits(step, self._generation_of(step, fence))
            ):
                visible[step] = None
            else:
                fenced.append(step)
        return visible, fenced

    def forget(self, step: int) -> None:
        """The manifest of ``step`` was removed or replaced."""
        self._known.pop(step, None)

    def _generation_of(self, step: int, fence: Fence) -> int | None:
        """The generation a manifest records. A corrupt manifest counts as the fence's (it then
        fails on load, loudly); a storage error propagates: a manifest must not turn visible
        because it could not be read."""
        if step in fence.accepted:
            return None  # visible whatever it says
        known = self._known.get(step)
        if known is not None and known >= fence.generation:
            return known
        try:
            doc = self._read(step, None)
        except CheckpointNotFoundError:
            return -1
        except (CorruptCheckpointError, FormatVersionError):
            return fence.generation
        generation: int = doc.generation
        if generation >= fence.generation:
            self._known[step] = generation
        return generation

    def claim(self, minimum: int, visible: Callable[[], dict[int, Version]]) -> int:
        """Claim the next generation (at least ``minimum``, above every generation claimed or
        written, and at least 1: 0 is the generation of writers that joined before any claim):
        write its fence record, accepting the ``visible()`` steps as they are, create-only."""
        generation = minimum
        while True:
            fence = newest(self.storage)
            steps = visible()
            written = 0
            if steps:
                last = max(steps)
                try:
                    written = self._read(last, steps[last]).generation + 1
                except CheckpointError:
                    written = 0
            # Generation 0 is what writers join while nothing was claimed: a claim is always
            # above it, or a writer that joined before the first claim (one frozen in its first
            # save) would write manifests as visible as the claimant's.
            generation = max(generation, written, fence.generation + 1 if fence else 1)
            data = record(generation, steps, minimum)
            path = fence_path(generation)
            # Create-only, then read back: on a backend whose create-only write is a check then
            # a write (no conditional writes), a racing claimant's record may have replaced
            # ours; then we did not win this number.
            if self.storage.put(path, data) and self.storage.get(path) == data:
                log.info("claimed generation %d (%d checkpoints visible)", generation, len(steps))
                return generation
            generation += 1  # another claimant took it first

    def check(self, step: int, generation: int, outcome: str) -> None:
        """Raise :class:`FencedError` when a newer generation took over and does not admit a
        manifest of ``step`` written by ``generation``, or this process was fenced off."""
        check_process(f"checkpoint step {step} {outcome}")
        fence = newest(self.storage)
        if fence is None or fence.admits(step, generation):
            return
        raise FencedError(
            f"checkpoint step {step} {outcome}: this writer is generation {generation} of "
            f"{self.storage.url}, but {fence.describe()} took over since. A restarted job owns "
            "the store now; this process must stop."
        )

    def check_compaction(self, step: int, generation: int, outcome: str) -> None:
        """:meth:`check` for the full base of ``step`` that a writer of ``generation`` rewrites
        it as."""
        check_process(f"compaction of step {step} {outcome}")
        fence = newest(self.storage)
        if fence is None or fence.admits_compaction(step, generation):
            return
        raise FencedError(
            f"compaction of checkpoint step {step} {outcome}: this writer is generation "
            f"{generation} of {self.storage.url}, but {fence.describe()} took over since; the "
            "step stays as it was committed. A restarted job owns the store now; this process "
            "must stop."
        )

    def displace(self, step: int, visible: Callable[[], Mapping[int, Version]]) -> None:
        """A manifest at ``step`` already exists: when a fenced-off generation wrote it (it is
        not visible), move it to quarantine so the current generation can commit the step."""
        if newest(self.storage) is None or step in visible():
            return
        source = mf.manifest_path(step)
        try:
            data = self.storage.get(source)
        except FileNotFoundError:
            return
        self.storage.put(f"{mf.QUARANTINE_DIR}/{step:020d}.fenced.json", data, overwrite=True)
        self.storage.delete(source)
        self.forget(step)
        log.warning(
            "moved checkpoint step %d, written by a fenced-off generation, to %s/",
            step,
            mf.QUARANTINE_DIR,
        )


class Generation:
    """The fencing generation one writer commits as: the one given or claimed, else the newest
    claimed in storage (0 when none was), fixed at first use.

    It also admits the writer to write (:meth:`admit`: the lease, and a claim after taking over
    an unreleased lease) and to delete (:meth:`check_current`)."""

    def __init__(self, storage: Storage, given: int | None) -> None:
        self.storage = storage
        self._value = given  # None: joins the newest claim

    @property
    def value(self) -> int:
        if self._value is None:
            fence = newest(self.storage)
            self._value = fence.generation if fence is not None else 0
        return self._value

    def admit(self, fencing: Fencing, lease: Lease, history: History) -> None:
        """Take (or confirm) the writer lease before a write. When that takes over a lease
        whose holder did not release it, claim a new generation at once, before anything is
        committed: the old holder may be frozen between its lease check and its manifest write
        (a suspended job, a stopped process, a partition), and its late manifest then names an
        older generation than the newest fence, so it is never visible, and it is told so
        (:class:`FencedError` from its commit).

        The claim accepts only the steps that were visible *before* the takeover: a manifest
        the old holder lands between this process writing its lease record and writing the
        fence is not accepted either. The caller holds the store's write lock.

        Raises:
            WriterLeaseError: another process holds the lease, or this one lost it.
            FencedError: this process was fenced off (:func:`fence_process`).
        """
        check_process("the store is not written")
        takeover, seen = self._acquire(lease, history, claiming=False)
        if takeover is None:
            return
        with history.lock:
            self._claim_after(takeover, seen, 0, fencing, lease, history)

    def claim(self, minimum: int, fencing: Fencing, lease: Lease, history: History) -> int:
        """Claim a new generation for this writer (see :meth:`Fencing.claim`): take the writer
        lease, claim, and record the new generation in the lease. The caller holds the store's
        write lock and the history's lock.

        Raises:
            FencedError: this process was fenced off (:func:`fence_process`).
        """
        check_process("no generation claimed")
        takeover, seen = self._acquire(lease, history, claiming=True)
        if takeover is not None:
            return self._claim_after(takeover, seen, minimum, fencing, lease, history)
        history.write_marker()
        self._value = fencing.claim(minimum, history.visible)
        lease.acquire(self._value)  # the record names the new generation
        return self._value

    def _acquire(
        self, lease: Lease, history: History, *, claiming: bool
    ) -> tuple[Takeover | None, set[int]]:
        """Take the lease; on a takeover also the steps visible just before it."""
        seen: list[set[int]] = []
        takeover = lease.acquire(
            self.value,
            claiming=claiming,
            before_takeover=lambda: seen.append(set(history.visible())),
        )
        return takeover, seen[-1] if takeover is not None else set()

    def _claim_after(
        self,
        takeover: Takeover,
        seen: set[int],
        minimum: int,
        fencing: Fencing,
        lease: Lease,
        history: History,
    ) -> int:
        old = takeover.generation if takeover.generation is not None else self.value
        history.write_marker()
        self._value = fencing.claim(
            max(minimum, self.value, old + 1),
            lambda: {s: v for s, v in history.visible().items() if s in seen},
        )
        lease.acquire(self._value)  # the record names the new generation
        log.warning(
            "claimed generation %d after taking over the writer lease of %s from %s: what that "
            "writer commits from now on is not visible",
            self._value,
            self.storage.url,
            takeover.holder,
        )
        return self._value

    def check_current(self, fencing: Fencing, lease: Lease, what: str) -> None:
        """Raise unless this store may still delete: when it writes (it took the lease), it
        still holds the lease and no newer generation was claimed since it joined. A store
        that never took the lease (``gc`` with a grace period) is not checked: the grace
        period and the minimum object age protect what others are writing.

        Raises:
            WriterLeaseError: this process lost the lease. FencedError: a newer generation, or
                this process was fenced off.
        """
        check_process(what)
        if not lease.held:
            return
        lease.check()
        fence = newest(self.storage)
        if fence is not None and fence.generation > self.value:
            raise FencedError(
                f"{what}: this writer is generation {self.value} of {self.storage.url}, but "
                f"{fence.describe()} took over since; it deletes nothing (the restarted job "
                "owns the store's retention now)"
            )
