"""A store object's view of the compactions and deletes made through the other store objects of
its process at its location (:attr:`.location.Location.rewrites`).

Such a rewrite may replace the version of the newest checkpoint that this object's delta base
remembers. The objects that version named are then named by no committed manifest: a gc in
another process, its grace period past, may delete them at any moment, and a save reusing them
would commit a checkpoint that loses them. So before a save encodes its part (under the
location's lock), a rewrite by another object since makes the delta base what is committed now,
its bases read from storage. Rare, and it costs one save's in-memory XOR base. The count this
object has taken into account is ``DeltaBase.rewrites_seen``.
"""

from __future__ import annotations

import logging

from lightning_incremental.core.chunks.delta_base import Parent
from lightning_incremental.core.commit.committer import Committer

log = logging.getLogger("lightning_incremental")


def ours(committer: Committer) -> None:
    """``committer``'s store object compacted or deleted a committed checkpoint, under the
    location's lock, and set its own delta base accordingly."""
    committer.base.rewrites_seen = committer.location.rewrote()


def rebase_if_others(committer: Committer) -> None:
    """Under the location's lock, before a part is encoded: rebuild the delta base on what is
    committed now when another store object of the process rewrote a checkpoint here since."""
    if committer.location.rewrites == committer.base.rewrites_seen:
        return
    committer.base.rewrites_seen = committer.location.rewrites
    newest = committer.history.newest_readable()
    log.info(
        "%s was compacted or had a checkpoint deleted through another store object of this "
        "process: the next save builds on what is committed now (step %s)",
        committer.storage.url,
        newest.step if newest is not None else None,
    )
    committer.base.set(Parent.of(newest))
