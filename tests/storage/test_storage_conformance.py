"""One conformance suite for every storage backend (the ``store_url`` fixture: local directory,
``memory://`` for fsspec's backend, ``s3://`` on moto's server on loopback, and a backend
written as another package would, tests/storage_plugin.py). Backend-agnostic: only the public
``open_storage`` / ``Storage`` interface and the ``CheckpointStore`` API are used; a test below
fails when a registered backend is not in the suite.

Part 1 pins the Storage interface the engine relies on; part 2 runs whole-store round trips.
"""

from __future__ import annotations

import math
import os
import resource
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from errno import EMFILE, ESTALE
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    NotAStoreError,
    StepError,
)
from lightning_incremental.core.storage import (
    Storage,
    backend_for,
    open_storage,
    registered_schemes,
)
from lightning_incremental.core.storage.filesystem import FsspecStorage
from lightning_incremental.core.storage.local import LocalStorage
from lightning_incremental.core.storage.s3 import S3Storage
from tests import storage_plugin
from tests.conftest import STORE_BACKENDS, assert_state_equal, backend_url, small_store
from tests.faulty import unreadable_directories

# The schemes whose backends the suite opens (besides local paths and fsspec's memory://).
SUITE_SCHEMES = {"s3": "s3", "plugin": storage_plugin.SCHEME}


@pytest.fixture(params=[*STORE_BACKENDS, "plugin"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    with backend_url(request.param, request, tmp_path) as url:
        yield url


def test_every_registered_backend_is_in_the_suite() -> None:
    """Adding a backend to the registry without adding it here fails."""
    tested = {backend_for(s).source for s in SUITE_SCHEMES.values() if backend_for(s)}
    for scheme in registered_schemes():
        found = backend_for(scheme)
        assert found is not None and found.source in tested, (
            f"{scheme}:// ({found.source if found else None}) is registered but the conformance "
            "suite does not open it: add it to store_url's params"
        )


# ---------------------------------------------------------------------------- Storage interface


@pytest.fixture
def storage(store_url: str) -> Storage:
    return open_storage(store_url, None)


DATA = bytes(range(256)) * 4 + b"tail"


def test_put_then_get_exists_size(storage: Storage) -> None:
    assert not storage.exists("packs/ab/obj")
    assert storage.put("packs/ab/obj", DATA) is True
    assert storage.exists("packs/ab/obj")
    assert storage.get("packs/ab/obj") == DATA
    assert storage.size("packs/ab/obj") == len(DATA)


def test_put_accepts_memoryview_and_empty_data(storage: Storage) -> None:
    assert storage.put("a/view", memoryview(DATA)[10:20]) is True
    assert storage.get("a/view") == DATA[10:20]
    assert storage.put("a/empty", b"") is True
    assert storage.exists("a/empty")
    assert storage.get("a/empty") == b""
    assert storage.size("a/empty") == 0


def test_put_is_create_only(storage: Storage) -> None:
    assert storage.put("manifests/x.json", b"first") is True
    assert storage.put("manifests/x.json", b"second, longer") is False
    assert storage.get("manifests/x.json") == b"first"
    assert storage.size("manifests/x.json") == len(b"first")


def test_put_overwrite_replaces(storage: Storage) -> None:
    assert storage.put("manifests/x.json", b"first, the longer one") is True
    assert storage.put("manifests/x.json", b"second", overwrite=True) is True
    assert storage.get("manifests/x.json") == b"second"
    assert storage.size("manifests/x.json") == len(b"second")
    assert storage.put("manifests/new.json", b"made", overwrite=True) is True
    assert storage.get("manifests/new.json") == b"made"


def test_put_parts_writes_their_concatenation(storage: Storage) -> None:
    parts = [DATA[:100], memoryview(DATA)[100:700], b"", DATA[700:]]
    assert storage.put_parts("packs/ab/parts", parts) is True
    assert storage.get("packs/ab/parts") == DATA
    assert storage.put_parts("packs/ab/parts", [b"other"]) is False  # create-only, as put
    assert storage.get("packs/ab/parts") == DATA
    assert storage.put_parts("packs/ab/parts", [b"ot", b"her"], overwrite=True) is True
    assert storage.get("packs/ab/parts") == b"other"
    assert storage.put_parts("packs/ab/none", []) is True
    assert storage.get("packs/ab/none") == b""
    assert storage.list("packs") == ["packs/ab/none", "packs/ab/parts"]


def test_put_parts_not_durable_yet_is_whole_to_readers_and_synced_later(storage: Storage) -> None:
    """``durable=False`` changes only when the object survives a crash (at ``sync``): readers
    see it whole at once, create-only and overwrite work as ever, and a sync of what was
    written (or of nothing) succeeds."""
    parts = [DATA[:300], memoryview(DATA)[300:]]
    assert storage.put_parts("packs/ab/later", parts, durable=False) is True
    assert storage.get("packs/ab/later") == DATA
    assert storage.put_parts("packs/ab/later", [b"other"], durable=False) is False
    assert storage.put_parts("packs/ab/later", [b"again"], overwrite=True, durable=False)
    assert storage.put_parts("packs/cd/later", [b"two"], durable=False) is True
    storage.sync(["packs/ab/later", "packs/cd/later"])
    storage.sync([])
    assert storage.get("packs/ab/later") == b"again"
    assert storage.list("packs") == ["packs/ab/later", "packs/cd/later"]


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, 10),
        (5, 9),
        (100, 1028),
        (None, 7),
        (1000, None),
        (0, None),
        (3, 3),
        (len(DATA) - 4, None),
    ],
)
def test_get_range(storage: Storage, start: int | None, end: int | None) -> None:
    storage.put("packs/cd/obj", DATA)
    assert storage.get("packs/cd/obj", start, end) == DATA[start:end]


def test_get_range_past_the_end_is_short_not_an_error(storage: Storage) -> None:
    """Restore detects truncated objects by the length of what a range read returns."""
    storage.put("packs/cd/obj", DATA)
    assert storage.get("packs/cd/obj", len(DATA) - 3, len(DATA) + 100) == DATA[-3:]
    assert storage.get("packs/cd/obj", len(DATA) + 5, len(DATA) + 9) == b""


def test_missing_object(storage: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.get("packs/ee/missing")
    with pytest.raises(FileNotFoundError):
        storage.get("packs/ee/missing", 0, 4)
    with pytest.raises(FileNotFoundError):
        storage.size("packs/ee/missing")
    assert storage.exists("packs/ee/missing") is False
    storage.delete("packs/ee/missing")  # deleting a missing object is fine
    storage.delete("never/made/dirs/x")


def test_delete(storage: Storage) -> None:
    storage.put("packs/ab/one", b"1")
    storage.put("packs/ab/two", b"2")
    storage.delete("packs/ab/one")
    assert not storage.exists("packs/ab/one")
    with pytest.raises(FileNotFoundError):
        storage.get("packs/ab/one")
    assert storage.list("packs") == ["packs/ab/two"]
    assert storage.put("packs/ab/one", b"again") is True  # a deleted name can be created again
    assert storage.get("packs/ab/one") == b"again"


def test_list_is_recursive_and_relative(storage: Storage) -> None:
    names = ["packs/ab/1.pack", "packs/ab/2.pack", "packs/cd/3.pack", "manifests/0.json", "top"]
    for name in names:
        storage.put(name, name.encode())
    assert sorted(storage.list("packs")) == names[:3]
    assert sorted(storage.list("packs/ab")) == ["packs/ab/1.pack", "packs/ab/2.pack"]
    assert sorted(storage.list("manifests")) == ["manifests/0.json"]
    assert storage.list("nothing-here") == []
    assert storage.list("pack") == [], "a prefix is a directory, not a string prefix"
    for path in storage.list("packs"):  # what list returns can be read back
        assert storage.get(path) == path.encode()


def test_list_of_the_root(storage: Storage) -> None:
    for name in ["packs/ab/1.pack", "store.json"]:
        storage.put(name, b"x")
    assert sorted(storage.list("")) == ["packs/ab/1.pack", "store.json"]


def test_listdir_is_one_level(storage: Storage) -> None:
    for name in ["top.json", "packs/ab/1.pack", "packs/x.json", "manifests/0.json"]:
        storage.put(name, b"x")
    assert storage.listdir("") == ["top.json"]
    assert storage.listdir("packs") == ["packs/x.json"]
    assert storage.listdir("packs/ab") == ["packs/ab/1.pack"]
    assert storage.listdir("packs/ab/") == ["packs/ab/1.pack"]
    assert storage.listdir("nothing-here") == []
    assert storage.listdir("pack") == []


def test_exists_of_the_location(storage: Storage) -> None:
    """``exists("")``: whether anything is at the location (how a path is told to be a store)."""
    assert storage.exists("") is False
    storage.put("packs/ab/obj", b"x")
    assert storage.exists("") is True


def test_list_shows_no_temporary_objects(storage: Storage) -> None:
    """A write is atomic: after it, the listing holds the object and nothing else."""
    storage.put("manifests/00.json", b"a" * 1000)
    storage.put("manifests/00.json", b"b" * 10, overwrite=True)
    storage.put("manifests/00.json", b"c")  # refused
    assert storage.list("manifests") == ["manifests/00.json"]


def test_mtime(storage: Storage) -> None:
    storage.put("packs/ab/obj", b"x")
    mtime = storage.mtime("packs/ab/obj")
    assert mtime is None or (isinstance(mtime, float) and math.isfinite(mtime) and mtime > 0)


def test_open_storage_reaches_the_same_objects(store_url: str) -> None:
    open_storage(store_url, None).put("packs/ab/shared", DATA)
    again = open_storage(store_url, None)
    assert again.get("packs/ab/shared") == DATA
    assert again.list("packs") == ["packs/ab/shared"]


# ---------------------------------------------------------------------------- store round trips


def _states(n: int) -> list[dict[str, Any]]:
    """A run of ``n`` states: dense small updates (XOR deltas), a sparse one, a frozen tensor,
    assorted dtypes and plain values."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=g)
    emb = torch.randn(96, 32, generator=g)
    frozen = torch.randn(1024, generator=g).to(torch.bfloat16)
    counts = torch.randint(0, 1000, (700,), generator=g, dtype=torch.int64)
    out = []
    for step in range(n):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        emb = emb.clone()
        emb[step % 96] -= 0.5
        counts = counts + (torch.arange(700) % (step + 2) == 0)
        out.append(
            {
                "model": {"w": w.clone(), "emb": emb.clone(), "frozen": frozen.clone()},
                "counts": counts.clone(),
                "flags": torch.tensor([True, False, step % 2 == 0]),
                "scalar": torch.tensor(float(step)),
                "empty": torch.empty(0, 3),
                "meta": {"step": step, "loss": 1.0 / (step + 1), "name": "run", "ids": (1, 2)},
            }
        )
    return out


def _assert_loads(store: CheckpointStore, expected: dict[int, dict[str, Any]]) -> None:
    assert store.steps() == sorted(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_state_equal(store.load(), expected[max(expected)])
    for step, state in expected.items():
        assert_state_equal(store.load(step), state)
        report = store.verify(step)
        assert report.ok, report


def test_store_round_trip(store_url: str) -> None:
    states = _states(5)
    with small_store(store_url, full_every=3) as store:
        results = [store.save(state, step * 10).wait() for step, state in enumerate(states)]
        _assert_loads(store, {i * 10: s for i, s in enumerate(states)})
    assert [r.full_base for r in results] == [True, False, False, True, False]
    assert sum(r.chunks_delta for r in results) > 0
    assert sum(r.chunks_reused for r in results) > 0
    with small_store(store_url) as fresh:  # another process opening the same location
        _assert_loads(fresh, {i * 10: s for i, s in enumerate(states)})
        with pytest.raises(CheckpointNotFoundError, match="step 5"):
            fresh.load(5)
        with pytest.raises(StepError):
            fresh.save(states[0], 40)  # not newer than the newest committed


def test_store_resumes_with_deltas_after_reopen(store_url: str) -> None:
    states = _states(4)
    with small_store(store_url) as store:
        store.save(states[0], 0).wait()
        store.save(states[1], 1).wait()
    with small_store(store_url) as store:
        assert_state_equal(store.load(), states[1])
        result = store.save(states[2], 2).wait()
        assert not result.full_base and result.chunks_delta > 0
        store.save(states[3], 3).wait()
    with small_store(store_url) as fresh:
        _assert_loads(fresh, dict(enumerate(states)))


def test_store_gc(store_url: str) -> None:
    states = _states(5)
    with small_store(store_url) as store:
        for step, state in enumerate(states):
            store.save(state, step).wait()
        storage = open_storage(store_url, None)
        before = set(storage.list("packs"))
        dry = store.gc(keep_last=2, dry_run=True)
        assert dry.removed_steps == [0, 1, 2] and set(storage.list("packs")) == before
        report = store.gc(keep_last=2)
        assert report.kept_steps == [3, 4] and report.removed_steps == [0, 1, 2]
        assert sorted(report.removed_objects) == sorted(dry.removed_objects)
        after = set(storage.list("packs"))
        assert after == before - set(report.removed_objects)
        # the kept deltas still need objects of the removed checkpoints: those stay
        _assert_loads(store, {3: states[3], 4: states[4]})
        assert store.gc().removed_objects == []  # nothing unreferenced is left


def test_store_keep_last(store_url: str) -> None:
    states = _states(6)
    with small_store(store_url, keep_last=2) as store:
        for step, state in enumerate(states):
            store.save(state, step).wait()
            assert store.steps() == list(range(max(0, step - 1), step + 1))
        _assert_loads(store, {4: states[4], 5: states[5]})


def test_store_compact(store_url: str) -> None:
    states = _states(4)
    with small_store(store_url) as store:
        for step, state in enumerate(states):
            store.save(state, step).wait()
        result = store.compact()
        assert result is not None and result.full_base and result.step == 3
        assert store.compact() is None  # already a full base
        _assert_loads(store, dict(enumerate(states)))
        store.gc(keep_last=1)
        _assert_loads(store, {3: states[3]})
        store.save(states[0], 4).wait()  # the history goes on after compaction
    with small_store(store_url) as fresh:
        _assert_loads(fresh, {3: states[3], 4: states[0]})


def test_empty_and_foreign_locations(store_url: str) -> None:
    with small_store(store_url) as store:
        assert store.steps() == []
        with pytest.raises(CheckpointNotFoundError):
            store.load()
    open_storage(store_url, None).put("data/something.bin", b"not a checkpoint")
    with small_store(store_url) as store:
        with pytest.raises(NotAStoreError):
            store.load()


def test_storage_instance_and_url_are_the_same_store(store_url: str) -> None:
    states = _states(2)
    with CheckpointStore(open_storage(store_url, None), chunk_size=4096, pack_size=16384) as a:
        a.save(states[0], 0).wait()
    with small_store(store_url) as b:
        b.save(states[1], 1).wait()
        _assert_loads(b, dict(enumerate(states)))


# ---------------------------------------------------------------------------- listing errors

# A listing is complete or an error: an unreadable directory read as an empty one makes
# retention see no checkpoints (and collect every object) and a fence vanish (and a fenced-off
# writer's checkpoint appear). Each backend below hits a real error of its own: a local
# directory whose reading fails (os.scandir, under os.walk or fsspec's LocalFileSystem), an S3
# listing request refused. The memory:// and plugin backends cannot fail a listing.

OBJECTS = ["packs/ab/1.pack", "packs/cd/2.pack", "manifests/0.json", "top.json"]


@pytest.fixture(params=["local", "fsspec", "s3"])
def breakable(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Storage, Callable[[str], Any]]]:
    """A storage holding OBJECTS, and ``fail(directory)``: a context in which every listing
    that reads ``directory`` (it, or a directory above it) fails."""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        faults = request.getfixturevalue("s3_faults")
        bucket = request.getfixturevalue("s3_bucket")
        options = endpoint.options(faulty=True)
        storage: Storage = S3Storage.from_url(f"s3://{bucket}/store", options)

        @contextmanager
        def fail(directory: str) -> Iterator[None]:
            parts = directory.split("/")
            for depth in range(len(parts) + 1):  # one request lists a prefix and all below it
                prefix = "/".join(["store", *parts[:depth]]) + "/"
                faults.error(
                    403, method="GET", query={"list-type": "2", "prefix": prefix}, times=None
                )
            try:
                yield
            finally:
                faults.clear()

    else:
        root = str(tmp_path / "store")
        if request.param == "local":
            storage = LocalStorage(root)
        else:  # fsspec's generic listing (a walk), as for sftp://, hdfs://, smb:// ...
            storage = FsspecStorage(LocalFileSystem(), root, url=f"file://{root}")

        def fail(directory: str) -> Any:
            return unreadable_directories(os.path.join(root, *directory.split("/")), errno=ESTALE)

    for name in OBJECTS:
        storage.put(name, name.encode())
    yield storage, fail


@pytest.mark.parametrize("directory", ["packs", "packs/cd"])
def test_a_listing_that_fails_raises(
    breakable: tuple[Storage, Callable[[str], Any]], directory: str
) -> None:
    """The directory itself, or one below the listed one: an error naming what was listed."""
    storage, fail = breakable
    with fail(directory):
        with pytest.raises(OSError, match=r"listing \S*packs"):
            storage.list("packs")
        with pytest.raises(OSError, match="listing"):
            storage.list("")
        assert storage.list("manifests") == ["manifests/0.json"]  # the others still list
        assert storage.list("nothing-here") == []  # a missing directory is still empty
    assert storage.list("packs") == OBJECTS[:2]


def test_a_one_level_listing_that_fails_raises(
    breakable: tuple[Storage, Callable[[str], Any]],
) -> None:
    storage, fail = breakable
    with fail("manifests"):
        with pytest.raises(OSError, match=r"listing \S*manifests"):
            storage.listdir("manifests")
        assert storage.listdir("nothing-here") == []
    assert storage.listdir("manifests") == ["manifests/0.json"]


def test_a_local_listing_out_of_file_descriptors_raises(tmp_path: Path) -> None:
    """EMFILE, a real error: the process may open no more files while the store is listed."""
    storage = LocalStorage(str(tmp_path / "store"))
    for name in OBJECTS:
        storage.put(name, name.encode())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    errors: list[OSError] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        for call in (lambda: storage.list("packs"), lambda: storage.listdir("manifests")):
            try:
                call()
            except OSError as exc:
                errors.append(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(errors) == 2 and all(e.errno == EMFILE for e in errors), errors
    assert "listing packs" in str(errors[0]) and "listing manifests" in str(errors[1])
