"""The writer lease: one writing process per store; a second gets an error naming the first;
a dead, stale or superseded writer's lease is taken over; readers need none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore, WriterLeaseError
from lightning_incremental.core.commit import fencing, owner
from lightning_incremental.core.commit import lease as lease_mod
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal, small_store


def records(url: str) -> dict[int, dict]:
    out = {}
    for path in sorted(Path(url, "lease").glob("*.json")):
        out[int(path.stem)] = json.loads(path.read_bytes())
    return out


def plant(url: str, sequence: int, **fields) -> None:
    """A lease record as another process would have written it."""
    doc = {
        "format": mf.FORMAT,
        "owner": "other-owner",
        "host": "another-host",
        "pid": 4242,
        "pidns": None,
        "job": None,
        "generation": 0,
        "acquired": "2024-01-01T00:00:00+00:00",
        "heartbeat": time.time(),
        "ttl_s": 60.0,
        "released": False,
    }
    doc.update(fields)
    path = Path(url, *lease_mod.lease_path(sequence).split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def seeded(url: str) -> dict:
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with small_store(url) as store:
        store.save(state, 1).wait()
    return state


def test_a_save_takes_the_lease_and_close_releases_it(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save({"w": torch.ones(4)}, 1).wait()
        (record,) = records(local_url).values()
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
        assert not record["released"] and record["generation"] == 0
        assert record["ttl_s"] == 60.0 and record["heartbeat"] <= time.time()
    (record,) = records(local_url).values()
    assert record["released"]


def test_a_live_writer_elsewhere_blocks_writes_but_not_reads(local_url: str) -> None:
    state = seeded(local_url)
    plant(local_url, 5)
    with small_store(local_url) as store:
        handle = store.save({"w": torch.zeros(64)}, 2)
        with pytest.raises(WriterLeaseError, match="host another-host pid 4242") as raised:
            handle.wait()
        assert isinstance(raised.value, PermissionError)
        assert "lease/0000000005.json" in str(raised.value)
        assert store.steps() == [1]
        assert_state_equal(store.load(), state)
        assert store.verify().ok
        assert store.gc(keep_last=1, grace_s=60).removed_steps == []
        with pytest.raises(WriterLeaseError):
            store.gc(keep_last=1)  # no grace period: only the writer may
        with pytest.raises(WriterLeaseError):
            store.compact()
        with pytest.raises(WriterLeaseError):
            store.delete(1)
    after = records(local_url)
    assert sorted(after) == [0, 5], "a refused writer writes no lease record"
    assert after[0]["released"]  # the earlier writer's, closed


@pytest.mark.parametrize(
    "fields",
    [
        {"heartbeat": time.time() - 3600},  # stale
        {"released": True},
        {
            "host": socket.gethostname(),
            "boot": owner.boot_id(),
            "pidns": owner.pid_namespace(),
            "pid": 2**22 + 7,
        },
    ],
    ids=["stale", "released", "dead-process-on-this-host"],
)
def test_an_abandoned_lease_is_taken_over(local_url: str, fields: dict) -> None:
    seeded(local_url)
    plant(local_url, 3, **fields)
    with small_store(local_url) as store:
        store.save({"w": torch.zeros(64)}, 2).wait()
        current = records(local_url)
        assert max(current) == 4 and current[4]["pid"] == os.getpid()
        assert_state_equal(store.load(), {"w": torch.zeros(64)})


def test_a_newer_generation_of_the_same_job_takes_over(local_url: str, monkeypatch) -> None:
    seeded(local_url)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    plant(local_url, 0, job="job-a", generation=0)
    with small_store(local_url) as store:
        assert store.claim_generation(1) == 1
        store.save({"w": torch.zeros(64)}, 2).wait()
        newest = records(local_url)[max(records(local_url))]
        assert newest["generation"] == 1 and newest["job"] == "job-a"


def test_another_job_cannot_take_over_by_claiming(local_url: str, monkeypatch) -> None:
    seeded(local_url)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    plant(local_url, 0, job="job-a", generation=0)
    with small_store(local_url) as store:
        with pytest.raises(WriterLeaseError, match="job job-a"):
            store.claim_generation(1)
    assert fencing.generations(LocalStorage(local_url)) == [], "no fence written"


def test_a_writer_that_lost_its_lease_stops_committing(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save({"w": torch.ones(8)}, 1).wait()
        (sequence,) = records(local_url)
        plant(local_url, sequence + 1, heartbeat=time.time())  # taken over (e.g. it froze)
        with pytest.raises(WriterLeaseError, match=r"lost the writer lease.*another-host"):
            store.save({"w": torch.ones(8)}, 2).wait()
        assert store.steps() == [1]
    assert records(local_url)[sequence + 1]["host"] == "another-host", "not released by us"


def test_the_heartbeat_renews_the_record(local_url: str) -> None:
    now = [1000.0]
    store = small_store(local_url)
    try:
        store._lease.clock = lambda: now[0]
        store.save({"w": torch.ones(8)}, 1).wait()
        held = store._lease._held
        assert held is not None
        held.clock = lambda: now[0]
        (record,) = records(local_url).values()
        now[0] += 30
        held.beat()
        (renewed,) = records(local_url).values()
        assert renewed["heartbeat"] == record["heartbeat"] + 30
    finally:
        store.close()


def test_stores_of_one_process_share_its_lease(local_url: str) -> None:
    """A maintenance store beside the training store in one process is the same writer."""
    with small_store(local_url) as job, small_store(local_url) as maintenance:
        job.save({"w": torch.ones(8)}, 1).wait()
        maintenance.delete(1)
        job.save({"w": torch.ones(8)}, 2).wait()
        assert len(records(local_url)) == 1
        maintenance.close()
        assert not records(local_url)[max(records(local_url))]["released"], "job still writes"
    assert records(local_url)[max(records(local_url))]["released"]


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from lightning_incremental.core import CheckpointStore
    store = CheckpointStore(sys.argv[1], fsync=False)
    store.save({"w": torch.ones(16)}, 1).wait()
    print("ready", flush=True)
    sys.stdin.readline()
    store.save({"w": torch.ones(16) * 2}, 3).wait()
    store.close()
    print("done", flush=True)
    """
)


def test_two_processes_writing_one_store(local_url: str) -> None:
    """The second process's save fails naming the first; once the first closes, or dies, the
    second writes."""
    for ending in ("close", "kill"):
        url = f"{local_url}-{ending}"
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            with CheckpointStore(url, fsync=False) as store:
                with pytest.raises(WriterLeaseError, match=f"pid {child.pid}"):
                    store.save({"w": torch.zeros(16)}, 2).wait()
                assert store.steps() == [1]
                if ending == "close":
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    assert child.stdout.readline().strip() == "done"
                    expected = [1, 3]
                else:
                    child.send_signal(signal.SIGKILL)
                    expected = [1]
                child.wait(60)
                assert store.steps() == expected
                store.save({"w": torch.zeros(16)}, 4).wait()
                assert store.steps() == [*expected, 4]
                assert_state_equal(store.load(), {"w": torch.zeros(16)})
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(60)


def test_a_store_collected_while_another_takes_the_lease_does_not_deadlock(
    tmp_path: Path, monkeypatch
) -> None:
    """Garbage collection can run a dropped store's finalizer on any thread, at any allocation —
    also inside ``Lease.acquire`` while it holds the registry lock (it allocates the lease's
    record). The finalizer then must not wait for that lock: its release is deferred, done by
    the next acquire or release, and the lease of the dropped store is released all the same."""
    dropped = small_store(str(tmp_path / "a"))
    dropped.save({"w": torch.ones(4)}, 1).wait()
    (finalizer,) = [  # the finalizer the store registered, as garbage collection would run it
        f
        for f in weakref.finalize._registry
        if (f.peek() or (None,))[0] is dropped  # type: ignore[attr-defined]
    ]
    original = lease_mod._Held.__init__

    def held_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        finalizer()  # as a garbage collection inside the registry's critical section would
        original(self, *args, **kwargs)

    monkeypatch.setattr(lease_mod._Held, "__init__", held_init)
    result: list[BaseException | None] = []

    def take() -> None:
        try:
            with small_store(str(tmp_path / "b")) as other:
                other.save({"w": torch.ones(4)}, 1).wait()
            result.append(None)
        except BaseException as exc:  # pragma: no cover - reported below
            result.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(20)  # a second, when it does not deadlock
    assert not thread.is_alive(), "deadlock: the finalizer waited for the registry lock"
    assert result == [None]
    monkeypatch.setattr(lease_mod._Held, "__init__", original)
    records = sorted((tmp_path / "a" / "lease").iterdir())
    assert json.loads(records[-1].read_text())["released"] is True
    assert not lease_mod._DROPPED


def test_a_second_independent_job_cannot_take_over_a_live_lease(
    local_url: str, monkeypatch
) -> None:
    """A takeover by generation needs both jobs known by the same launcher id: an unknown id on
    either side is another, independent job, and a live holder is not taken over."""
    seeded(local_url)
    for theirs, mine in ((None, None), (None, "job-b"), ("job-a", None)):
        if mine is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", mine)
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        plant(local_url, 7, job=theirs, generation=0)
        with small_store(local_url) as store:
            with pytest.raises(WriterLeaseError, match="launcher id"):
                store.claim_generation(1)
            with pytest.raises(WriterLeaseError, match="host another-host pid 4242"):
                store.save({"w": torch.zeros(64)}, 2).wait()
        assert fencing.generations(LocalStorage(local_url)) == [], "no fence written"


LAUNCHER_VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_RESTART_COUNT",
)


def launched(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """This process as the launcher would start it: exactly ``variables`` set."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_the_job_id_comes_from_the_launcher(monkeypatch) -> None:
    launched(monkeypatch)
    assert owner.job_id() is None and owner.job_requeue() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # static multi-node torchrun
    assert owner.job_id() is None
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert owner.job_id() == "torchrun:node0:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "4711")  # the batch script: no step id
    assert owner.job_id() == "slurm:4711"
    monkeypatch.setenv("SLURM_STEP_ID", "2")  # srun's job step 2
    assert owner.job_id() == "slurm:4711.2"
    assert owner.job_requeue() == ("slurm:4711", 0)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert owner.job_requeue() == ("slurm:4711", 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    assert owner.job_id() == "3f2a.2"
    monkeypatch.delenv("SLURM_STEP_ID")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert owner.job_id() == "3f2a" and owner.job_requeue() is None


def holder_record(url: str, sequence: int, **fields: object) -> None:
    """The live lease record this code writes in this environment, as a process on another
    host holds it (its pid cannot be checked here)."""
    doc = json.loads(lease_mod._Held(LocalStorage(url), 60.0, time.time).body())
    doc.update(host="another-host", pid=4242, boot=None, owner="other-owner", **fields)
    plant(url, sequence, **doc)


def test_a_second_step_of_one_slurm_allocation_cannot_take_over(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job steps of one allocation share SLURM_JOB_ID; each is a job of its own. A second step
    writing the store of a live first one is refused, claiming a generation or not (taking the
    lease would fence off the first step's commits)."""
    seeded(local_url)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_STEP_ID="0")
    holder_record(local_url, 7)
    for second in ({"SLURM_STEP_ID": "1"}, {"SLURM_STEP_ID": "1", "TORCHELASTIC_RUN_ID": "4711"}):
        launched(monkeypatch, SLURM_JOB_ID="4711", **second)
        with small_store(local_url) as store:
            with pytest.raises(WriterLeaseError, match=r"job slurm:4711\.0\b"):
                store.claim_generation(1)
            with pytest.raises(WriterLeaseError, match="host another-host pid 4242"):
                store.save({"w": torch.zeros(64)}, 2).wait()
    launched(monkeypatch)  # the batch script of the allocation is another step as well
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    with small_store(local_url) as store:
        with pytest.raises(WriterLeaseError, match="launcher id"):
            store.claim_generation(1)
    assert fencing.generations(LocalStorage(local_url)) == [], "no fence written"
    assert max(records(local_url)) == 7, "the first step still holds the lease"


@pytest.mark.parametrize("step", ["0", "3"])
def test_a_requeued_slurm_job_takes_over_by_generation(
    local_url: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """SLURM requeues a job under its job id after every process of it ended, numbering its steps
    afresh: the requeued run takes the lease over from its previous run by generation, whether
    its step has the same number or another; the previous run can never take it back."""
    seeded(local_url)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_STEP_ID="0")
    holder_record(local_url, 7)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_STEP_ID=step, SLURM_RESTART_COUNT="1")
    with small_store(local_url) as store:
        assert store.claim_generation(1) == 1
        store.save({"w": torch.zeros(64)}, 2).wait()
        newest = records(local_url)[max(records(local_url))]
        assert newest["job"] == f"slurm:4711.{step}" and newest["requeue"] == ["slurm:4711", 1]
        assert newest["pid"] == os.getpid() and newest["generation"] == 1
        held = records(local_url)[max(records(local_url))]
    held.update(host="another-host", pid=4242, owner="other-owner")  # still running, elsewhere
    plant(local_url, max(records(local_url)) + 1, **held)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_STEP_ID="0")  # the earlier run, awake
    with small_store(local_url) as store:
        with pytest.raises(WriterLeaseError, match="requeued SLURM job"):
            store.claim_generation(2)


def test_another_machine_of_the_same_host_name_is_not_this_one(local_url: str) -> None:
    """Host name and pid namespace are not unique (the pid namespace inode is one constant on
    every Linux host): a live record from another boot is not checked against this machine's
    processes, so its absent pid does not make it abandoned."""
    seeded(local_url)
    same_name = {"host": socket.gethostname(), "pidns": owner.pid_namespace()}
    plant(local_url, 3, boot="another-boot-id", pid=2**22 + 7, **same_name)
    with small_store(local_url) as store:
        with pytest.raises(WriterLeaseError, match="is being written by another process"):
            store.save({"w": torch.zeros(64)}, 2).wait()
    plant(local_url, 4, pid=2**22 + 7, **same_name)  # an older record without a boot id
    with small_store(local_url) as store:
        with pytest.raises(WriterLeaseError, match="is being written by another process"):
            store.save({"w": torch.zeros(64)}, 2).wait()
    assert owner.boot_id(), "this machine has a boot id"


def test_taking_over_an_unreleased_lease_claims_a_generation(local_url: str) -> None:
    """A stale holder may wake and commit: the new holder claims a generation above the
    holder's before its first commit, accepting only the steps that were there before."""
    seeded(local_url)
    plant(local_url, 3, heartbeat=time.time() - 3600, generation=4)
    with small_store(local_url) as store:
        store.save({"w": torch.zeros(64)}, 2).wait()
        assert store.generation == 5 and store.manifest(2).generation == 5
        fence = fencing.newest(store.storage)
        assert fence is not None and fence.generation == 5 and fence.accepted == {1}
    plant(local_url, 9, released=True)  # a released lease: no claim
    with small_store(local_url) as store:
        store.save({"w": torch.ones(64)}, 3).wait()
        assert fencing.generations(store.storage) == [5]
