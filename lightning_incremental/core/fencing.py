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

Create-only writes (local link, S3 ``If-None-Match``) make two claimants of the same number
impossible: the loser takes the next number. On a backend without an atomic create-only write
(an S3 endpoint without conditional writes, some fsspec filesystems) the claimant reads its record
back, which narrows the race but cannot close it: there, fencing is best effort. Stores that
never claim join the newest generation.

A damaged newest fence record (e.g. truncated by a crash with ``fsync=False``) stops every read
with an error naming it; deleting that file restores the previous generation's rule.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core import manifest as mf
from lightning_incremental.core.errors import ManifestError
from lightning_incremental.core.storage import Storage

FENCE_DIR = "fences"
_NAME = re.compile(r"^(\d{10,})\.json$")  # zero-padded to 10 digits, longer when larger
_MAX_ACCEPTED = 10_000_000


@dataclass(frozen=True)
class Fence:
    """The newest claim: its generation and the steps visible when it was made."""

    generation: int
    accepted: frozenset[int]
    record: dict[str, Any]

    def admits(self, step: int, generation: int | None) -> bool:
        """Whether a manifest of ``step`` written by ``generation`` is visible under this fence
        (``generation`` None: unknown, e.g. unreadable)."""
        if step in self.accepted:
            return True
        return generation is not None and generation >= self.generation

    def describe(self) -> str:
        who = self.record.get("host"), self.record.get("pid"), self.record.get("created")
        return f"generation {self.generation} (claimed by host {who[0]} pid {who[1]} at {who[2]})"


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
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != mf.FORMAT:
        raise ManifestError(f"{where} is not a fence record of this library")
    accepted = doc.get("accepted")
    if doc.get("generation") != generation or not isinstance(accepted, list):
        raise ManifestError(f"{where} does not record generation {generation} and its steps")
    if len(accepted) > _MAX_ACCEPTED or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in accepted
    ):
        raise ManifestError(f"{where} lists invalid steps")
    return Fence(generation, frozenset(accepted), doc)


def record(generation: int, accepted: list[int], minimum: int) -> bytes:
    """A new fence record's bytes."""
    body = {
        "format": mf.FORMAT,
        "generation": generation,
        "accepted": sorted(accepted),
        "requested": minimum,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    return json.dumps(body, sort_keys=True).encode()
