"""What the store objects of one process on one location share besides the writer lease: the
write lock, and a count of the sweeps run there.

Saves hold the lock while they write and commit, and ``gc``, ``delete`` and ``compact`` while
they delete or rewrite, whichever store object of the process they go through: a maintenance
store beside the training store waits for the save in flight, and the save for it. A compact or
a delete through one store object also tells the others (``rewrites``): the training store's
next save then builds on what is committed, not on the version its delta base remembers. A sharded
save cannot hold it from its part to its commit (the ranks' collectives lie between), so its
coordinator compares the count of sweeps before its part and at its commit: when a sweep ran in
between, every object the parts reuse is checked to be there before the manifest is written.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field


@dataclass
class Location:
    """This process's lock of one store location, how many sweeps ran there, and how many
    times a store object of the process rewrote (compacted) or deleted a committed checkpoint
    there."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    sweeps: int = 0
    rewrites: int = 0

    def swept(self) -> None:
        """A sweep (which may have deleted objects) ended; the caller holds the lock."""
        self.sweeps += 1

    def rewrote(self) -> int:
        """A committed checkpoint was rewritten or deleted; the caller holds the lock. Every
        other store object of the process here builds its next save on what is committed now
        (its delta base may name the objects of the version that is gone, which no manifest
        protects from a gc any more); returns the new count."""
        self.rewrites += 1
        return self.rewrites


_LOCATIONS: dict[tuple[int, str], Location] = {}
_GUARD = threading.Lock()


def location(url: str) -> Location:
    """This process's :class:`Location` of the store at ``url``, one per location whatever the
    number of store objects open there (a small record per location ever opened is kept; a
    child process made by fork gets its own, as its parent's lock may be held)."""
    key = (os.getpid(), url)
    with _GUARD:
        found = _LOCATIONS.get(key)
        if found is None:
            found = _LOCATIONS[key] = Location()
        return found
