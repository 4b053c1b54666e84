"""The versions of a step's manifest: the commit's own, and the full bases compactions rewrote
it as.

A committed manifest is never replaced in place. A compaction writes the step's full base as
``manifests/<step>.c<generation>.json``, naming the generation of the writer that made it, so
that the fence decides whether it is visible exactly as it decides for a commit
(:meth:`.fencing.Fence.admits_compaction`): a compactor frozen past a takeover lands a version
nobody reads, and the step's commit it meant to replace is still there. Of the visible versions
the newest compaction is the step's manifest; the versions it supersedes are removed by the
writer once its compaction is known to be visible (and by ``gc``), never before.

Why not overwrite: on an object store nothing makes "check the fence, then replace" atomic, and
a replacement by a writer that lost the race destroys the only copy of a visible checkpoint
(its new objects may be swept by the new generation meanwhile). A new name that only a
fenced-in writer can make visible is what the commit protocol already relies on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_incremental.core.format import layout as mf

Version = int | None  # the compaction's generation, or None: the commit's own manifest


@dataclass(frozen=True)
class Versions:
    """The manifests one listing found for a step."""

    original: bool = False
    compactions: tuple[int, ...] = ()  # generations, ascending

    def paths(self, step: int) -> list[str]:
        """Every manifest of the step."""
        own = [mf.manifest_path(step)] if self.original else []
        return own + [mf.manifest_path(step, g) for g in self.compactions]

    def superseded(self, step: int, current: Version) -> list[str]:
        """The manifests of the step other than ``current``'s (the one that is visible)."""
        return [p for p in self.paths(step) if p != mf.manifest_path(step, current)]


def by_step(paths: Iterable[str]) -> dict[int, Versions]:
    """The manifests among ``paths`` (a listing of ``manifests/``), by step."""
    originals: set[int] = set()
    compactions: dict[int, list[int]] = {}
    for path in paths:
        if path.count("/") != 1:
            continue
        parsed = mf.manifest_name(path.rsplit("/", 1)[-1])
        if parsed is None:
            continue
        step, generation = parsed
        if generation is None:
            originals.add(step)
        else:
            compactions.setdefault(step, []).append(generation)
    return {
        step: Versions(step in originals, tuple(sorted(compactions.get(step, ()))))
        for step in sorted(originals | set(compactions))
    }
