"""Work that must finish when the interpreter exits: saves in flight, and what follows them.

At exit Python stops thread pools from taking new work, and the daemon threads a
:class:`~lightning_incremental.core.workers.WorkerPool` runs are ended without waiting: a save
still being written would be lost. :func:`drain_at_exit` registers an owner (a store, an
adapter) whose ``drain`` finishes that work first. One interpreter hook runs every registered
drain, newest registration first (an adapter that registers after opening its stores — or again
at each save — is drained before them), while the thread pools still take work: hooks registered
with ``threading._register_atexit`` run before ``concurrent.futures``' own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("lightning_incremental")

_lock = threading.Lock()
_owners: dict[int, tuple[weakref.ref[Any], Callable[[Any], object]]] = {}  # registration order
_hooked = False


def drain_at_exit(owner: object, drain: Callable[[Any], object]) -> None:
    """Call ``drain(owner)`` when the interpreter exits, if ``owner`` is still alive then (it
    is held by a weak reference). Registering an owner again replaces its drain and makes it
    the newest registration (drained first)."""
    global _hooked
    key = id(owner)
    ref = weakref.ref(owner)  # no callback: one would run at any allocation, under the lock
    with _lock:
        for dead in [k for k, (r, _) in _owners.items() if r() is None]:
            del _owners[dead]  # owners gone since (an id may be reused: purge before adding)
        _owners.pop(key, None)
        _owners[key] = (ref, drain)
        if _hooked:
            return
        try:
            threading._register_atexit(_drain_all)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # no such hook, or already shutting down
            return
        _hooked = True


def _drain_all() -> None:
    with _lock:
        registered = list(_owners.values())
    for ref, drain in reversed(registered):
        owner = ref()
        if owner is None:
            continue
        try:
            drain(owner)
        except Exception as exc:  # the process is ending: say what was lost, loudly
            log.error("work of %r failed while the process was exiting: %s", owner, exc)
