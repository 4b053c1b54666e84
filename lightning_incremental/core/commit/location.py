"""What the store objects of one process on one location share besides the writer lease: the
write lock, and a count of the sweeps run there.

Saves hold the lock while they write and commit, and ``gc``, ``delete`` and ``compact`` while
they delete or rewrite, whichever store object of the process they go through: a maintenance
store beside the training store waits for the save in flight, and the save for it. A sharded
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
    """This process's lock of one store location, and how many sweeps ran there."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    sweeps: int = 0

    def swept(self) -> None:
        """A sweep (which may have deleted objects) ended; the caller holds the lock."""
        self.sweeps += 1


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
