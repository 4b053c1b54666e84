"""What a fork holds of its own: the objects of the forked step that lie in another shared object
pool are copied into the fork's pool while the fork is made; the others are referenced.

Each object a fork's checkpoints name is kept by whoever may delete it, and that decides:

- in the fork's own pool: by the pool's collection, which reads every member's manifests, pins
  and fork base (:data:`~..commit.history.FORK_BASE`) — the fork is a member. Referenced.
- in a plain store's own location (the source's, or one the source was forked from): by that
  store's retention alone, which keeps what the fork's pin names (and ``unpin`` down the chain is
  refused while a fork of a fork still needs it). Referenced.
- in another pool: by that pool's collection, which knows the fork only through the source's
  pin, and only while the source is its member. Once the source is deleted and leaves that pool
  nothing there protects the fork's objects, and that pool's collection cannot be asked to read
  stores outside it (other buckets, other credentials; a fork it cannot read would stop it).
  Copied into the fork's pool: the fork then needs nothing of that pool.

The copy runs after the source's pin is checked (it protects the objects meanwhile) and before
the fork's links and manifest are written: a fork that fails or stops midway leaves only
unreferenced young objects in its pool, which its collection removes later, and no pin. Each
object is read through the source (from its pool's trash too), checked against its size and the
content hash its name carries, and written create-only; an object the fork's pool holds already
is not written again. Then every object the fork's pool must hold is looked up once more, and
what vanished meanwhile (a collection of that pool with a minimum age shorter than the copy took)
is copied again, so the fork commits within the minimum age of that check, as a save commits
within the minimum age of its writes.

Cost: up to two existence checks per object in each location the source reads from, then one
read and one write per copied object, ``COPY_WORKERS`` at a time (at most that many objects in
memory), and one existence check per object the fork's pool holds. Nothing of this runs for a
fork whose objects lie in its own pool or in plain stores only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.linked import trash_path

COPY_WORKERS = 8  # objects read and written at a time
RECOPY_ROUNDS = 3  # checks of the fork's pool before the copy gives up on objects that vanish

T = TypeVar("T")
R = TypeVar("R")


def _each(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    todo = list(items)
    if len(todo) <= 1:
        return [fn(item) for item in todo]
    with ThreadPoolExecutor(COPY_WORKERS, thread_name_prefix="li-fork-copy") as pool:
        return list(pool.map(fn, todo))


def holder(readers: Sequence[Storage], path: str) -> int | None:
    """The index of the location a read of ``path`` through ``readers`` finds it in (the first
    holding it, then the first whose trash does: :class:`~..storage.linked.LinkedStorage`'s
    order); None when none does."""
    for where in (path, trash_path(path)):
        for index, reader in enumerate(readers):
            if reader.exists(where):
                return index
    return None


def copy_foreign(
    source: Storage,
    readers: Sequence[Storage],
    foreign: Sequence[bool],
    into: Storage,
    packs: Mapping[str, int],
    where: str,
) -> list[str]:
    """Copy into ``into`` (the fork's pool) every object of ``packs`` (path -> size) that a
    read through ``source`` finds in a location of ``readers`` marked ``foreign`` (another
    pool) and that ``into`` lacks; returns the paths written.

    Raises:
        CheckpointNotFoundError: an object is in no location (removed while the fork was made),
            or objects copied keep vanishing from ``into``.
        CorruptCheckpointError: an object's bytes do not match its size or name.
    """

    def needs(path: str) -> tuple[bool, bool]:  # (into must hold it, it must be copied)
        if into.exists(path):
            return True, False
        found = holder(readers, path)
        if found is None:
            raise CheckpointNotFoundError(
                f"{where} lost object {path} while it was being forked; fork a step its "
                "retention keeps"
            )
        return foreign[found], foreign[found]

    def copy(path: str) -> str:
        try:
            data = source.get(path)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{where} lost object {path} while it was being forked; fork a step its "
                "retention keeps"
            ) from exc
        if len(data) != packs[path] or mf.pack_path(chunk_hash(data)) != path:
            raise CorruptCheckpointError(
                f"{where}: object {path} is damaged ({len(data)} bytes, {packs[path]} expected, "
                "or its content does not match its name); nothing was forked. Verify the "
                "source (`lightning-incremental verify`) and fork a step that verifies"
            )
        into.put(path, data)
        return path

    paths = sorted(packs)
    verdicts = _each(needs, paths)
    held = [p for p, (hold, _) in zip(paths, verdicts) if hold]
    copied = _each(copy, [p for p, (_, must) in zip(paths, verdicts) if must])
    for _ in range(RECOPY_ROUNDS):
        gone = [p for p, there in zip(held, _each(into.exists, held)) if not there]
        if not gone:
            return copied
        copied += _each(copy, gone)
    raise CheckpointNotFoundError(
        f"objects copied into {into.url} for {where} keep vanishing from it: a collection of "
        "that pool with a minimum age shorter than the fork takes runs; nothing was forked. "
        "Fork again while no such collection runs (pool-gc --min-age longer than any save)"
    )
