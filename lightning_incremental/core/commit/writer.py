"""Whether this process can write a store, asked before a run depends on it.

A training run saves its first checkpoint minutes or hours after it starts. Found only then, a
second writer (another job holding the store's writer lease, :mod:`.lease`) or a store this
process cannot write (a read-only directory, a permission it lacks, a bucket without write
access) costs that time, and a resumed run has by then loaded the other run's state and trained
on it. :func:`acquire` finds both at the start instead, the way the first save would:

1. It takes the writer lease, or confirms this process holds it (claiming a fencing generation
   first where the caller asks: a restarted job of the same run takes over from its previous
   incarnation as a newer generation, see :mod:`.fencing`). A live writer of another job is
   refused (:class:`~lightning_incremental.core.errors.WriterLeaseError` naming its host, pid
   and job, and what to do) before anything is written: its lease, fences and checkpoints are
   untouched. A lease whose holder is dead or stale is taken over as a save would take it.
2. It writes, then deletes, an empty object under a temporary name (``.tmp-writable-<uuid>``)
   in the store's ``lease/`` directory, and in the shared object pool's ``packs/`` where the
   store keeps its data objects there: temporary names, which readers never look at and every
   sweep removes when a crash leaves one behind. Taking the lease writes too; the probe also
   covers a lease this process already held and the pool's location.

A storage error on the way is a
:class:`~lightning_incremental.core.errors.StoreNotWritableError` naming the location and the
error; the lease is not kept then (unless this process held it before).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning_incremental.core.commit.lease import LEASE_DIR, Lease
from lightning_incremental.core.errors import CheckpointError, StorageError, StoreNotWritableError
from lightning_incremental.core.storage import TMP_PREFIX, Storage
from lightning_incremental.core.storage.linked import OBJECT_DIR, LinkedStorage

PROBE_NAME = f"{TMP_PREFIX}writable-"


def probe_paths(storage: Storage) -> list[tuple[Storage, str]]:
    """Where :func:`acquire` writes its probe: (location, path) pairs, with fresh names."""
    name = f"{PROBE_NAME}{uuid.uuid4().hex}"
    places: list[tuple[Storage, str]] = [(storage, f"{LEASE_DIR}/{name}")]
    if isinstance(storage, LinkedStorage) and storage.objects is not storage.own:
        places.append((storage.objects, f"{OBJECT_DIR}/{name}"))  # the pool's data objects
    return places


def probe(storage: Storage) -> None:
    """Write and delete an empty object in each location the store writes to.

    Raises:
        OSError: the location cannot be written (or the object deleted).
    """
    for where, path in probe_paths(storage):
        where.put(path, b"", overwrite=True)
        where.delete(path)


def acquire(lease: Lease, admit: Callable[[], None]) -> None:
    """Take the writer ``lease`` (``admit``: claim and/or admit, under the store's locks) and
    probe that its store can be written (see the module documentation).

    Raises:
        WriterLeaseError: another process holds the lease.
        FencedError: this process was fenced off.
        StoreNotWritableError: the store cannot be written.
    """
    held = lease.held
    with _refusing_unwritable(lease.storage.url):
        try:
            admit()
            probe(lease.storage)
        except BaseException:
            if not held:
                lease.release()  # a writer refused at its start keeps no lease
            raise


@contextmanager
def _refusing_unwritable(url: str) -> Iterator[None]:
    try:
        yield
    except StorageError as exc:
        raise _not_writable(url, exc) from exc
    except CheckpointError:  # WriterLeaseError, FencedError, ...: their own words
        raise
    except OSError as exc:  # a backend that raises the bare OSError
        raise _not_writable(url, exc) from exc


def _not_writable(url: str, exc: OSError) -> StoreNotWritableError:
    return StoreNotWritableError(
        exc.errno,
        f"cannot write the checkpoint store {url}: {exc.strerror or exc}. Saving checkpoints "
        "there needs permission to create, replace and delete objects: point this run at a "
        "location it can write (another dirpath), or grant it that access. Nothing was saved. "
        "Reading the store's checkpoints (loading, evaluating, verify) needs no write access.",
    )
