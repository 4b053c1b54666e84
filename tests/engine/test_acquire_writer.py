"""``CheckpointStore.acquire_writer``: the check a run makes at its start, before it resumes or
trains — a live writer of another job is refused naming it, and left alone; a store that cannot
be written is refused naming the location and the error; a dead writer's lease is taken over
and a restarted job takes over as a newer generation, as a save would."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import (
    CheckpointStore,
    StorageError,
    StoreNotWritableError,
    WriterLeaseError,
)
from lightning_incremental.core.commit import fencing, owner
from lightning_incremental.core.commit.writer import PROBE_NAME
from lightning_incremental.core.storage import open_storage
from lightning_incremental.runtime.cluster import writing
from tests.conftest import assert_state_equal, dead_pid
from tests.engine.test_lease import launched, plant, records
from tests.faulty import FaultyStorage, read_only_directory
from tests.live_writer import JOB, live_writer, store_files


def seeded(url: str) -> dict:
    state = {"w": torch.arange(32, dtype=torch.float32)}
    with CheckpointStore(url, fsync=False) as store:
        store.save(state, 1).wait()
    return state


def no_probe_left(url: str) -> bool:
    return not [p for p in Path(url).rglob("*") if p.name.startswith(PROBE_NAME)]


def test_a_live_writer_of_another_job_is_refused_and_left_alone(local_url: str) -> None:
    state = seeded(local_url)
    with live_writer(local_url) as live:
        before = store_files(local_url)
        with CheckpointStore(local_url, fsync=False) as store:
            with pytest.raises(WriterLeaseError) as raised:
                store.acquire_writer()
            message = str(raised.value)
            for named in (f"host {socket.gethostname()}", f"pid {live.pid}", f"job {JOB}"):
                assert named in message
            assert "wait for that writer to finish" in message
            assert "another location (another dirpath)" in message
            assert "takes the store over 60s after its last heartbeat" in message
            with pytest.raises(WriterLeaseError):
                store.acquire_writer(claim=1)  # claiming does not take another job's lease
            assert_state_equal(store.load(), state)  # reading needs no lease
        assert store_files(local_url) == before, "the refused writer changed the store"
    assert live.still_writer
    assert fencing.generations(open_storage(local_url, None)) == []


@pytest.mark.parametrize("checkpoints", [True, False], ids=["with-checkpoints", "empty"])
def test_a_read_only_store_is_refused_naming_it_and_the_error(
    tmp_path: Path, checkpoints: bool
) -> None:
    url = str(tmp_path / "store")
    state = seeded(url) if checkpoints else None
    os.makedirs(url, exist_ok=True)
    before = store_files(url)
    with read_only_directory(url):
        with CheckpointStore(url, fsync=False) as store:
            with pytest.raises(StoreNotWritableError) as raised:
                store.acquire_writer()
            if state is not None:
                assert_state_equal(store.load(), state)
    assert isinstance(raised.value, StorageError) and isinstance(raised.value, OSError)
    assert raised.value.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    message = str(raised.value)
    assert f"cannot write the checkpoint store {url}" in message
    assert os.strerror(raised.value.errno) in message  # the storage's own error
    assert "another dirpath" in message
    assert store_files(url) == before


def test_a_bucket_without_write_access_is_refused(tmp_path: Path) -> None:
    """A backend that refuses every write (and raises the bare ``PermissionError``)."""
    url = str(tmp_path / "store")
    seeded(url)
    storage = FaultyStorage(open_storage(url, None))
    for phase in ("other", "pack", "manifest", "marker"):
        storage.fail(phase, times=None, errno=errno.EACCES, translate=False)
    with CheckpointStore(storage) as store:
        with pytest.raises(StoreNotWritableError, match="Permission denied") as raised:
            store.acquire_writer()
        assert raised.value.errno == errno.EACCES
        assert store.steps() == [1]


def test_a_pool_that_cannot_be_written_is_refused_and_the_lease_not_kept(
    tmp_path: Path,
) -> None:
    """The probe also writes where the store keeps its data objects: a shared pool."""
    url, pool = str(tmp_path / "store"), str(tmp_path / "pool")
    with CheckpointStore(url, pool=pool, fsync=False) as store:
        store.save({"w": torch.ones(8)}, 1).wait()
    with read_only_directory(pool):
        with CheckpointStore(url, fsync=False) as store:
            with pytest.raises(StoreNotWritableError, match="pool"):
                store.acquire_writer()
            newest = records(url)[max(records(url))]
            assert newest["pid"] == os.getpid() and newest["released"], "the lease was kept"
    assert no_probe_left(url) and no_probe_left(pool)


def test_the_probe_leaves_nothing_and_a_save_follows(local_url: str) -> None:
    seeded(local_url)
    with CheckpointStore(local_url, fsync=False) as store:
        assert store.acquire_writer() == 0
        (sequence,) = [s for s, r in records(local_url).items() if not r["released"]]
        assert records(local_url)[sequence]["pid"] == os.getpid()
        assert no_probe_left(local_url)
        assert store.acquire_writer() == 0  # held: confirmed, the same record
        assert max(records(local_url)) == sequence
        store.save({"w": torch.zeros(32)}, 2).wait()
        assert store.steps() == [1, 2]
    assert records(local_url)[sequence]["released"]


def test_a_dead_writers_lease_is_taken_over(local_url: str) -> None:
    seeded(local_url)
    plant(
        local_url,
        5,
        host=socket.gethostname(),
        boot=owner.boot_id(),
        pidns=owner.pid_namespace(),
        pid=dead_pid(),
        job="some-job",
    )
    with CheckpointStore(local_url, fsync=False) as store:
        generation = store.acquire_writer()
        assert generation >= 1, "a takeover claims a newer generation"
        assert records(local_url)[6]["pid"] == os.getpid()


def test_a_restarted_job_takes_over_from_its_previous_incarnation(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun --max-restarts: the same job id, a newer generation, the old lease still fresh
    (its holder on another machine, perhaps frozen rather than dead)."""
    seeded(local_url)
    launched(monkeypatch, TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="2")
    plant(local_url, 3, job="job-a", generation=1)
    with CheckpointStore(local_url, fsync=False) as store:
        assert writing.begin(store, claim=fencing.should_claim(1)) == 2
        assert records(local_url)[max(records(local_url))]["job"] == "job-a"


def test_a_requeued_slurm_job_claims_and_takes_over_from_its_earlier_run(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single process requeued by SLURM onto another node while the lease of its earlier run
    is still fresh: it claims a generation, so it takes that lease over at its start."""
    seeded(local_url)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_RESTART_COUNT="1")
    assert fencing.should_claim(1)
    plant(local_url, 2, job="slurm:4711", requeue=["slurm:4711", 0], generation=0)
    with CheckpointStore(local_url, fsync=False) as store:
        assert writing.begin(store, claim=fencing.should_claim(1)) == 1
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_RESTART_COUNT="0")
    assert not fencing.should_claim(1), "the first run of a job claims nothing by itself"


def test_the_lease_record_written_is_the_first_write(local_url: str) -> None:
    """Refused by a live lease: the check writes nothing at all (not even a probe)."""
    seeded(local_url)
    plant(local_url, 4)  # another host's live writer
    before = store_files(local_url)
    with CheckpointStore(local_url, fsync=False) as store:
        with pytest.raises(WriterLeaseError, match="host another-host pid 4242"):
            store.acquire_writer()
    assert store_files(local_url) == before
    assert json.loads(Path(local_url, "lease", "0000000004.json").read_text())["pid"] == 4242
