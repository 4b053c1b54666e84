"""The saves in flight in this process, per store location.

A save is visible only once it commits, and it commits in the background. A reader in the same
process — another :class:`~lightning_incremental.core.CheckpointStore` on the same URL, another
Lightning plug-in instance (a second ``Trainer``) — must see what this process saved before it
asked, not fail on a checkpoint that is a few milliseconds from committing. Every save registers
here under its store's location; a load first waits for the saves registered under its location.

Locations are compared normalised: local paths absolute with symbolic links resolved, URLs
without a trailing ``/``. An absolute local path is resolved once per process and remembered:
``realpath`` makes a ``lstat`` call per component, which every ``save`` would pay inside its
stall (milliseconds each while the store's own writes flush the same file system). A link
changed later is not seen: stores keep their location for their lifetime.
"""

from __future__ import annotations

import os
import re
import threading

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")

_lock = threading.Lock()
_saves: dict[str, list[threading.Event]] = {}


_RESOLVED: dict[str, str] = {}  # absolute local path -> its realpath (see the notes)
_RESOLVED_MAX = 1024


def location(url: str | os.PathLike[str]) -> str:
    """``url`` normalised: the key saves are registered and waited for under."""
    text = os.fspath(url)
    match = _SCHEME.match(text)
    if match is None or match.group(1).lower() == "file":
        local = os.path.expanduser(text[len("file://") :] if match else text)
        if not os.path.isabs(local):  # relative to the current directory, which may change
            return os.path.realpath(local)
        found = _RESOLVED.get(local)
        if found is None:
            if len(_RESOLVED) >= _RESOLVED_MAX:
                _RESOLVED.clear()
            found = _RESOLVED[local] = os.path.realpath(local)
        return found
    return text.rstrip("/")


def track(url: str | os.PathLike[str], done: threading.Event) -> None:
    """Register a save to ``url`` that is in flight until ``done`` is set."""
    key = location(url)
    with _lock:
        events = [e for e in _saves.get(key, ()) if not e.is_set()]
        events.append(done)
        _saves[key] = events


def pending(url: str | os.PathLike[str]) -> int:
    """How many saves to ``url`` are in flight in this process."""
    with _lock:
        return sum(1 for e in _saves.get(location(url), ()) if not e.is_set())


def wait(url: str | os.PathLike[str], timeout: float | None = None) -> bool:
    """Wait for every save to ``url`` registered before this call to finish (committed or
    failed: the outcome is the saver's to report). Returns whether there was one to wait for.

    Raises:
        TimeoutError: they did not all finish within ``timeout`` seconds.
    """
    key = location(url)
    with _lock:
        events = [e for e in _saves.get(key, ()) if not e.is_set()]
        if events:
            _saves[key] = events
        else:
            _saves.pop(key, None)
    for event in events:
        if not event.wait(timeout):
            raise TimeoutError(f"a save to {url} is still in flight after {timeout}s")
    return bool(events)
