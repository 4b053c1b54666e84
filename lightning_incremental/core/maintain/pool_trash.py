"""The pool's trash: where the pool's collection (:mod:`.pool_gc`) moves an object no member
needs, and how one listing of it is tidied — entries named again go back to ``packs/``, entries
that entered it at least the minimum age before the collection's time are purged. Why this loses
no committed step's object, and what a stopped collection leaves, is :mod:`.pool_gc`'s account.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable

from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.sweep import STALE_TMP_S
from lightning_incremental.core.storage import TMP_PREFIX, LocalStorage, Storage, translate_errors
from lightning_incremental.core.storage.durable import fsync_dir
from lightning_incremental.core.storage.linked import TRASH_DIR, trash_path

log = logging.getLogger("lightning_incremental")

MOVED = ".moved"  # beside a trash entry: its modification time is when the entry entered it


class Trash:
    """The pool's trash: moves into it, and the tidying of what one listing of it found."""

    def __init__(self, pool: Storage) -> None:
        self.pool = pool
        self.entries: set[str] = set()  # data object paths (``packs/...``) held in the trash
        self.marked: set[str] = set()  # ... whose marker was listed
        self.temporary: list[str] = []

    def list(self) -> None:
        """One listing of the trash; raises (an OSError) before anything is done when it
        fails: a failed listing is never an empty one."""
        cut = len(TRASH_DIR) + 1
        for name in self.pool.list(TRASH_DIR):
            if name.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
                self.temporary.append(name)
            elif name.endswith(MOVED) and mf.is_pack_path(name[cut : -len(MOVED)]):
                self.marked.add(name[cut : -len(MOVED)])
            elif mf.is_pack_path(name[cut:]):
                self.entries.add(name[cut:])

    def move(self, path: str) -> None:
        """Move data object ``path`` from ``packs/`` to the trash (over an entry there), then
        write its marker. FileNotFoundError when ``path`` is gone."""
        pool, entry = self.pool, trash_path(path)
        if isinstance(pool, LocalStorage):  # a rename: atomic, whatever writes path meanwhile
            source = os.path.join(pool.root, *path.split("/"))
            target = os.path.join(pool.root, *entry.split("/"))
            with translate_errors(f"moving {path} to the trash of {pool.root}"):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(source, target)
            if pool.fsync:
                fsync_dir(os.path.dirname(target))
                fsync_dir(os.path.dirname(source))
        else:  # no rename: the copy holds the same bytes as anything the delete removes
            pool.put(entry, pool.get(path), overwrite=True)
            pool.delete(path)
        pool.put(entry + MOVED, b"", overwrite=True)

    def tidy(
        self,
        live: set[str],
        planned_at: float,
        min_age_s: float,
        dry_run: bool,
        guard: Callable[[], None],
    ) -> tuple[builtins.list[str], builtins.list[str], int]:
        """Restore the listed entries that ``live`` names, purge those that entered the trash
        at least ``min_age_s`` before ``planned_at`` (see the module docstring); returns the
        objects restored, purged, and the bytes purged (or that would be, with ``dry_run``).
        ``guard`` runs before each change: it raises once this collection lost the lease."""
        pool = self.pool
        restored: builtins.list[str] = []
        purged: builtins.list[str] = []
        freed = undated = 0
        for path in sorted(self.entries):
            entry = trash_path(path)
            try:
                if path not in self.marked and pool.exists(path):
                    continue  # a move stopped before its delete: packs/ holds the object
                if path in live:
                    if not dry_run:
                        guard()
                        if not pool.exists(path):
                            pool.put(path, pool.get(entry))  # create-only
                        pool.delete(entry)
                        pool.delete(entry + MOVED)
                    restored.append(path)
                    continue
                if path not in self.marked:  # it left packs/ before now: it entered by now
                    if not dry_run:
                        pool.put(entry + MOVED, b"")
                    continue
                if min_age_s > 0:
                    entered = pool.mtime(entry + MOVED)
                    if entered is None:
                        undated += 1
                        continue
                    if planned_at - entered < min_age_s:
                        continue
                size = pool.size(entry)
                if not dry_run:
                    guard()  # just before: the marker read above is still this entry's
                    pool.delete(entry)
                    pool.delete(entry + MOVED)
            except FileNotFoundError:
                continue  # another collection's doing
            purged.append(path)
            freed += size
        if not dry_run:
            guard()
            for path in sorted(self.marked - self.entries):  # a purge or restore stopped
                pool.delete(trash_path(path) + MOVED)
            for name in self.temporary:  # of copies into the trash that were interrupted
                mtime = pool.mtime(name)
                if mtime is not None and planned_at - mtime >= max(min_age_s, STALE_TMP_S):
                    pool.delete(name)
        if undated:
            log.warning(
                "%s gives no modification times: %d trash entries were kept, the time they "
                "entered the trash unknown",
                pool.url,
                undated,
            )
        return restored, purged, freed
