"""A listing that fails is unknown, never empty: retention and gc delete nothing, a fence that
cannot be listed hides nothing it fences off, and a load says the listing failed.

The errors are real ones of the backend: reading a local directory fails (``os.scandir``
raises, as on a failing disk or a stale NFS handle; tests/faulty.py ``unreadable_directories``),
or the S3 endpoint refuses a listing request (tests/s3_server.py's fault proxy).
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import StorageError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain import retention
from lightning_incremental.core.storage.s3 import S3Storage
from tests.conftest import assert_state_equal, small_store
from tests.faulty import unreadable_directories
from tests.s3_server import FaultPlan, S3Endpoint


def state(value: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(value))
    return {"w": torch.randn(4096, generator=g) + value, "b": torch.arange(64) * value}


def files(url: str) -> set[str]:
    root = Path(url)
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_retention_after_a_commit_deletes_nothing_when_a_listing_fails(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One EIO while the retention after a commit lists the manifests: the commit stands, the
    retention deletes nothing and says why (a warning, and in the save's result)."""
    with small_store(local_url, keep_last=2, full_every=100, min_object_age_s=0) as store:
        store.save(state(1), 1).wait()
        store.save(state(2), 2).wait()
        before = files(local_url)
        manifests = os.path.join(local_url, mf.MANIFEST_DIR)
        run = retention.Collector.run
        seen: list[list[str]] = []

        def failing_run(self: retention.Collector, plan: retention.Plan) -> object:
            with unreadable_directories(manifests, errno=errno.EIO) as failed:
                try:
                    return run(self, plan)
                finally:
                    seen.append(list(failed))

        monkeypatch.setattr(retention.Collector, "run", failing_run)
        with pytest.warns(UserWarning, match=r"retention after step 3 failed.*listing manifests"):
            result = store.save(state(3), 3).wait()
        assert seen and seen[0], "the retention listed the manifests, and that failed"
        assert any("listing manifests" in w for w in result.warnings)
        monkeypatch.undo()
        after = files(local_url)
        assert before <= after, f"deleted: {sorted(before - after)}"
        assert store.steps() == [1, 2, 3]
        for step in (1, 2, 3):
            assert_state_equal(store.load(step), state(step))
        store.save(state(4), 4).wait()  # the next retention, listing again, keeps two
        assert store.steps() == [3, 4]
        assert_state_equal(store.load(3), state(3))


def test_gc_deletes_nothing_when_a_listing_fails(local_url: str) -> None:
    with small_store(local_url, min_object_age_s=0) as store:
        for step in (1, 2, 3):
            store.save(state(step), step).wait()
        before = files(local_url)
        for directory in (mf.MANIFEST_DIR, "fences"):
            with unreadable_directories(os.path.join(local_url, directory)):
                with pytest.raises(StorageError, match=f"listing {directory}"):
                    store.gc(keep_last=1, grace_s=0)
            assert files(local_url) == before
        assert store.gc(keep_last=1, grace_s=0).removed_steps == [1, 2]


def test_a_fence_that_cannot_be_listed_hides_what_it_fences_off(local_url: str) -> None:
    """A checkpoint the newest generation fenced off stays invisible: when the fences cannot be
    listed, the steps are unknown (an error), not every manifest."""
    with small_store(local_url) as old:
        old.claim_generation()
        old.save(state(1), 1).wait()
        old.save(state(2), 2).wait()
    # Step 2 of generation 1 was not there when generation 2 was claimed: it is fenced off.
    stale = Path(local_url, *mf.manifest_path(2).split("/"))
    aside = Path(local_url).parent / "aside.json"
    shutil.move(stale, aside)
    with small_store(local_url) as new:
        assert new.claim_generation() == 2
    shutil.move(aside, stale)
    fences = os.path.join(local_url, "fences")
    with small_store(local_url) as reader:
        assert reader.steps() == [1]
        with unreadable_directories(fences, errno=errno.ESTALE) as failed:
            with pytest.raises(StorageError, match="listing fences"):
                reader.steps()
            with pytest.raises(StorageError, match="listing fences"):
                reader.load()
        assert failed
        assert reader.steps() == [1]
    with small_store(local_url) as fresh, unreadable_directories(fences):
        with pytest.raises(StorageError, match="listing fences"):
            fresh.steps()


def test_a_load_says_the_listing_failed(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save(state(1), 1).wait()
    with small_store(local_url) as reader:
        with unreadable_directories(os.path.join(local_url, mf.MANIFEST_DIR)):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback, no "empty store"
                with pytest.raises(StorageError, match=r"listing manifests.*Input/output error"):
                    reader.load()
        assert_state_equal(reader.load(), state(1))


def test_retention_after_a_commit_on_s3_deletes_nothing_when_a_listing_fails(
    s3_endpoint: S3Endpoint, s3_bucket: str, s3_faults: FaultPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the S3 endpoint: the listing of the manifests refused while the retention
    after a commit runs."""
    storage = S3Storage.from_url(f"s3://{s3_bucket}/store", s3_endpoint.options(faulty=True))
    with small_store(storage, keep_last=2, full_every=100, min_object_age_s=0) as store:
        store.save(state(1), 1).wait()
        store.save(state(2), 2).wait()
        before = set(s3_endpoint.objects(s3_bucket))
        run = retention.Collector.run

        def failing_run(self: retention.Collector, plan: retention.Plan) -> object:
            s3_faults.error(
                403,
                method="GET",
                query={"list-type": "2", "prefix": "store/manifests/"},
                times=None,
            )
            try:
                return run(self, plan)
            finally:
                s3_faults.clear()

        monkeypatch.setattr(retention.Collector, "run", failing_run)
        with pytest.warns(UserWarning, match=r"retention after step 3 failed.*listing"):
            store.save(state(3), 3).wait()
        monkeypatch.undo()
        assert before <= set(s3_endpoint.objects(s3_bucket))
        assert store.steps() == [1, 2, 3]
        for step in (1, 2, 3):
            assert_state_equal(store.load(step), state(step))
