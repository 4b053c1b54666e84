"""Pins: records in a store that keep one of its checkpoints, and every object it names, for
a fork that references them.

A pin lies at ``pins/<name>.json`` in the pinned store's own location and records the step,
the fork's URL, and the data objects the pinned manifest named when the fork was made (the
fork's copy of that manifest names exactly these). Retention (``gc``, ``delete``, the
``keep_last`` after each commit, the removal of versions a compaction superseded) keeps the
pinned step and treats the pinned objects as live whatever happens to the step's manifest; the
pool's collection marks them too. A pin is removed only by :func:`~.pool.unpin`.

A fork also pins each store its source reads objects from (a fork of a fork reads from its
grandparent): such a pin records ``via``, the source's URL, and its step is the source's, so it
keeps objects only, no step of the store it lies in. The fork then holds its own references
wherever its objects lie, whatever becomes of its source (removed, or its own pin there
removed once the source was gone). A version without ``via`` takes the step as pinned: it
keeps more, never less.

A pin that cannot be read stops retention (nothing is deleted): what it protects is unknown.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format.layout import loads_record
from lightning_incremental.core.storage import Storage

PIN_DIR = "pins"
_FORMAT = "lightning-incremental-pin"


@dataclass(frozen=True)
class Pin:
    step: int
    by: str  # the URL of the fork that references the step's objects
    packs: tuple[str, ...]
    created: float
    via: str | None = None  # a pin of objects a fork reads through its source at this URL

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "format": _FORMAT,
            "step": self.step,
            "by": self.by,
            "created": self.created,
            "packs": list(self.packs),
        }
        if self.via is not None:
            doc["via"] = self.via
        return json.dumps(doc, sort_keys=True).encode()


def pin_path(by: str) -> str:
    """Where the pin a fork at URL ``by`` holds lies in its source."""
    return f"{PIN_DIR}/{hashlib.sha256(by.encode()).hexdigest()[:32]}.json"


def new_pin(step: int, by: str, packs: list[str], via: str | None = None) -> Pin:
    return Pin(step, by, tuple(sorted(packs)), time.time(), via)


def parse_pin(data: bytes, where: str) -> Pin:
    """The pin in ``data``.

    Raises:
        CorruptCheckpointError: it is not a pin record.
    """
    try:
        doc = loads_record(data)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a pin record")
        step, by, packs = doc["step"], doc["by"], doc["packs"]
        if not isinstance(step, int) or not isinstance(by, str) or not isinstance(packs, list):
            raise ValueError("malformed fields")
        if not all(isinstance(p, str) and p.startswith("packs/") for p in packs):
            raise ValueError("an object outside packs/")
        via = doc.get("via")
        if via is not None and not isinstance(via, str):
            raise ValueError("via is not a URL")
        return Pin(step, by, tuple(packs), float(doc.get("created", 0.0)), via)
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise CorruptCheckpointError(
            f"pin {where} is unreadable ({exc}): what it protects is unknown, so nothing is "
            "deleted; restore it, or remove it once no fork needs the step"
        ) from exc


def read_pins(storage: Storage) -> list[Pin]:
    """Every pin in the store (one listing, one read per pin); a pin removed meanwhile is
    skipped.

    Raises:
        OSError: the listing or a read failed (never an empty result instead).
        CorruptCheckpointError: a pin is unreadable.
    """
    pins = []
    for path in storage.list(PIN_DIR):
        if not path.endswith(".json"):
            continue
        try:
            data = storage.get(path)
        except FileNotFoundError:
            continue
        pins.append(parse_pin(data, f"{path} of {storage.url}"))
    return pins
