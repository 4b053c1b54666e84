"""Fault tolerance end to end: ``torchrun --nproc-per-node 2 --max-restarts 2`` (gloo, CPU) runs
of ``tests/jobs/torchrun_job.py`` with real SIGKILL and SIGSTOP, each ending bitwise equal to a
fault-free run of the same script.

Six launches in all (a reference, two with two faults each, three with a flipped bit under each
replica-check action, the last one also with a hang) share one module fixture, so the suite pays
for them once. The detection latency and recovery time they show are printed (``-s``) and quoted
in docs/guides/recovery.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit import fencing
from lightning_incremental.core.format import layout as mf
from lightning_incremental.runtime.cluster.watchdog import (
    EXIT_ISOLATED,
    EXIT_PEER_DEAD,
    EXIT_PEER_HUNG,
)
from tests.forwarder import Forwarder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "torchrun_job.py"
LAUNCH_TIMEOUT_S = 420


def torchrun(
    work: Path,
    name: str,
    faults: list[str],
    zombie: bool = False,
    replica_check: str = "warn",
    partition: bool = False,
) -> dict[str, Any]:
    """Launch the job; with ``zombie``, send SIGCONT to the frozen rank once the others ended;
    with ``partition``, route the ``cut`` rank's store link through a forwarder that is cut
    when the rank says so and healed once that run's ranks all ended."""
    out = work / name
    out.mkdir(parents=True)
    link = (
        Forwarder(lambda: ("127.0.0.1", int((out / "upstream").read_text()))) if partition else None
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.1",
        str(JOB),
        "--dir",
        str(work / f"{name}_store"),
        "--out",
        str(out),
    ]
    for fault in faults:
        cmd += ["--fault", fault]
    cmd += ["--replica-check", replica_check]
    # torchrun's agent shares its rendezvous TCPStore with the workers by default, and a
    # restarted group then reads the previous attempt's gloo addresses from it and cannot
    # connect (pytorch/pytorch#135712): each attempt gets its own store with this setting.
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    if link is not None:
        env["LI_TEST_STORE_PROXY"] = str(link.port)
    log = (out / "torchrun.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    waker = threading.Thread(target=_wake_zombie, args=(out, proc), daemon=True)
    if zombie:
        waker.start()
    cut: dict[str, float] = {}
    if link is not None:
        threading.Thread(target=_cut_and_heal, args=(out, proc, link, cut), daemon=True).start()
    try:
        rc = proc.wait(LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        if link is not None:
            link.close()
    events = _events(out)
    text = (out / "torchrun.log").read_text()
    assert rc == 0, f"torchrun exited with {rc}:\n{text[-6000:]}"
    return {
        "out": out,
        "store": work / f"{name}_store",
        "events": events,
        "log": text,
        "cut": cut,
    }


def _events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wake_zombie(out: Path, proc: subprocess.Popen) -> None:
    """Wait until a rank froze itself and every other rank of its run ended; then SIGCONT it."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        events = _events(out)
        frozen = [e for e in events if e["event"] == "signal" and e["kind"] == "stop"]
        if frozen:
            stop = frozen[0]
            others = {
                e["pid"]
                for e in events
                if e["event"] == "started" and e["restart"] == stop["restart"]
            } - {stop["pid"]}
            if others and all(not _alive(pid) for pid in others):
                os.kill(stop["pid"], signal.SIGCONT)
                return
        time.sleep(0.05)


def _cut_and_heal(
    out: Path, proc: subprocess.Popen, link: Forwarder, cut: dict[str, float]
) -> None:
    """Cut the link when a rank asks for it; heal it once every rank of that run ended."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        events = _events(out)
        asked = [e for e in events if e["event"] == "signal" and e["kind"] == "cut"]
        if asked and not cut:
            link.cut()
            cut["time"] = time.time()
        if cut:
            ranks = {e["pid"] for e in events if e["event"] == "started" and e["restart"] == 0}
            if ranks and all(not _alive(pid) for pid in ranks):
                link.heal()
                cut["healed"] = time.time()
                return
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("torchrun")
    return {
        "reference": torchrun(work, "reference", []),
        # restart 0: rank 1 dies at step 5; restart 1: rank 0 dies at step 9
        "kills": torchrun(work, "kills", ["0:1:5:kill", "1:0:9:kill"]),
        # restart 0: rank 1 freezes at step 5 (a zombie, woken once the group gave up on it);
        # restart 1: rank 0 dies while committing checkpoint 10, its data written
        "zombie": torchrun(work, "zombie", ["0:1:5:stop", "1:0:10:commit"], zombie=True),
        # rank 1 flips a bit of a weight right before the checkpoint of step 6 checks replicas
        "warn": torchrun(work, "warn", ["0:1:6:flip"], replica_check="warn"),
        "repair": torchrun(work, "repair", ["0:1:6:flip"], replica_check="repair"),
        # ... and in the restarted run, rank 1 hangs at step 9
        "stop": torchrun(work, "stop", ["0:1:6:flip", "1:1:9:hang"], replica_check="stop"),
        # rank 1's link to the job's store is cut at step 5 (gloo links stay up); it is healed
        # once both ranks of that run ended
        "partition": torchrun(work, "partition", ["0:1:5:cut"], partition=True),
    }


def final_weights(run: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run["out"] / f"final_rank{r}.pt") for r in (0, 1)]


def assert_bitwise_equal(run: dict[str, Any], reference: dict[str, Any]) -> None:
    for mine, ref in zip(final_weights(run), final_weights(reference)):
        assert mine.keys() == ref.keys()
        for key in ref:
            assert torch.equal(mine[key], ref[key]), key


def started(run: dict[str, Any], restart: int, rank: int = 0) -> dict[str, Any]:
    (event,) = [
        e
        for e in run["events"]
        if e["event"] == "started" and e["restart"] == restart and e["rank"] == rank
    ]
    return event


def test_the_reference_runs_without_a_restart(runs: dict[str, dict[str, Any]]) -> None:
    ref = runs["reference"]
    assert {e["restart"] for e in ref["events"]} == {0}
    assert started(ref, 0)["resumed_from"] is None
    assert started(ref, 0)["generation"] == 1


def test_sigkill_of_rank_1_then_of_rank_0_recovers_bit_exactly(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = runs["kills"]
    assert_bitwise_equal(run, runs["reference"])
    signals = [e for e in run["events"] if e["event"] == "signal"]
    assert [(e["restart"], e["rank"], e["step"]) for e in signals] == [(0, 1, 5), (1, 0, 9)]
    # Each restart resumed from a checkpoint taken before its fault: at most one interval lost
    # (2 steps), plus the save that was still being written when rank 0 died.
    first, second = started(run, 1), started(run, 2)
    assert first["resumed_from"] in (2, 4) and second["resumed_from"] in (6, 8)
    assert [started(run, r)["generation"] for r in (0, 1, 2)] == [1, 2, 3]
    for restart in (1, 2):  # every rank resumed from the same step
        assert started(run, restart, 1)["resumed_from"] == started(run, restart)["resumed_from"]
    _report(run, "kill")


def test_a_frozen_rank_is_fenced_off_and_the_run_recovers_bit_exactly(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = runs["zombie"]
    assert_bitwise_equal(run, runs["reference"])
    events = run["events"]
    (stop,) = [e for e in events if e["event"] == "signal" and e["kind"] == "stop"]
    # Rank 0 noticed the frozen rank through its watchdog (gloo would have waited 30 minutes)
    # and ended with the documented exit code.
    found = [e for e in events if e["event"] == "watchdog" and e["restart"] == 0]
    assert found and found[0]["rank"] == 0, events
    assert "rank 1 sent no heartbeat" in found[0]["message"]
    assert (
        f"exitcode: {EXIT_PEER_DEAD}" in run["log"] or f"exitcode : {EXIT_PEER_DEAD}" in run["log"]
    )
    latency = found[0]["time"] - stop["time"]
    # heartbeat_timeout after rank 1's last heartbeat, plus a check interval; that heartbeat
    # left up to an interval (0.25 s) before the freeze, or two when its thread ran late
    assert 3.0 - 0.5 <= latency < 3.0 + 10.0, latency
    print(f"\nstop: rank 0's watchdog ended the survivor {latency:.1f}s after the freeze")
    _report(run, "stop")

    # The store: the fences of three generations; the frozen generation's checkpoints end at
    # the freeze; the checkpoint whose commit was killed is not the one that is visible.
    store = CheckpointStore(run["store"])
    try:
        assert fencing.generations(store.storage) == [1, 2, 3]
        visible = store.steps()
        assert visible == list(range(2, 13, 2)), visible
        by_step = {s: store.manifest(s).generation for s in visible}
        # Generation g + 1 is restart g's (0 is what writers join before any claim).
        fence1 = fencing.parse(store.storage.get(fencing.fence_path(2)), 2, "fence 2")
        assert all(s <= stop["step"] for s in fence1.accepted)
        assert all(by_step[s] == 1 for s in fence1.accepted)
        assert all(g >= 2 for s, g in by_step.items() if s not in fence1.accepted)
        # Checkpoint 10 is the one restart 2 wrote; restart 1 died before committing it.
        assert by_step[10] == 3
        fence2 = fencing.parse(store.storage.get(fencing.fence_path(3)), 3, "fence 3")
        assert 10 not in fence2.accepted and max(fence2.accepted) < 10
        assert started(run, 2)["resumed_from"] == max(fence2.accepted)
        # Nothing outside the visible history: no stray manifests from any generation.
        written = sorted(
            mf.step_of(p.rsplit("/", 1)[-1]) for p in store.storage.list(mf.MANIFEST_DIR)
        )
        assert written == visible
    finally:
        store.close()


def _report(run: dict[str, Any], kind: str) -> None:
    """Print, for every fault of the run, when and from which step training resumed."""
    for fault in (e for e in run["events"] if e["event"] == "signal"):
        resumed = started(run, fault["restart"] + 1)
        print(
            f"\n{kind} run, {fault['kind']} of rank {fault['rank']} at step {fault['step']}: "
            f"training resumed from step {resumed['resumed_from']} "
            f"{resumed['time'] - fault['time']:.1f}s after the signal"
        )


def replica_findings(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run["events"] if e["event"] == "replicas"]


def test_a_diverged_replica_is_reported_under_warn(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["warn"]
    findings = replica_findings(run)
    # Found at the check of step 6 and at every later one (the bit stays flipped), on each rank.
    assert len(findings) >= 2 * 4, findings
    for finding in findings:
        assert "1 of 2 ranks differ" in finding["message"]
        assert "rank 1: 1 of" in finding["message"] and "model/net.0.weight" in finding["message"]
    assert {e["restart"] for e in run["events"]} == {0}
    with CheckpointStore(run["store"]) as store:  # rank 0 holds the reference copy: all saved
        assert store.steps() == list(range(2, 13, 2))
    rank0, rank1 = final_weights(run)
    assert not torch.equal(rank0["net.0.weight"], rank1["net.0.weight"])


def test_repair_restores_a_common_state_and_the_run_ends_bit_exactly(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = runs["repair"]
    assert_bitwise_equal(run, runs["reference"])
    findings = replica_findings(run)
    assert {(e["rank"]) for e in findings} == {0, 1} and len(findings) == 2, findings
    assert "model/net.0.weight" in findings[0]["message"]
    with CheckpointStore(run["store"]) as store:
        assert store.steps() == list(range(2, 13, 2))
        repair = store.manifest(6).audit["metadata"]["replica_repair"]
        assert repair == {
            "diverged_ranks": [1],
            "source_rank": 0,
            "repaired": ["model/net.0.weight"],
            "repaired_count": 1,
        }
        assert "replica_repair" not in store.manifest(8).audit["metadata"]


def test_stop_restarts_from_the_last_good_checkpoint(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["stop"]
    assert_bitwise_equal(run, runs["reference"])
    assert replica_findings(run)
    assert "exitcode: 89" in run["log"]
    assert started(run, 1)["resumed_from"] == 4  # the diverged step 6 was never committed
    with CheckpointStore(run["store"]) as store:
        assert store.steps() == list(range(2, 13, 2))
        assert store.manifest(6).generation == 2


def test_a_hung_rank_is_found_by_the_watchdog_and_the_run_recovers(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Restart 1 of the ``stop`` run: rank 1 stops making progress at step 9 (its heartbeat
    goes on), rank 0 waits for it in a collective. The watchdogs name rank 1 (furthest behind)
    after ``progress_timeout`` (or, once a process that named it has ended, find the
    coordination store gone), the processes end with exit code 87 (88), the group restarts from
    the newest checkpoint and the run ends bitwise equal to the reference (asserted above)."""
    run = runs["stop"]
    (hang,) = [e for e in run["events"] if e["event"] == "signal" and e["kind"] == "hang"]
    found = [e for e in run["events"] if e["event"] == "watchdog" and e["restart"] == 1]
    named = [e for e in found if "rank 1 made no training progress" in e["message"]]
    assert named, found
    # The first watchdog to name rank 1 ends its process; the coordination store may go with
    # it before the other watchdog's check (the agent's SIGTERM is a preemption request, which
    # the hung rank cannot honour at a step boundary): that one then says so, and blames no one.
    others = [e for e in found if e not in named]
    assert all("could not reach the coordination store" in e["message"] for e in others), found
    assert f"exitcode: {EXIT_PEER_HUNG}" in run["log"]
    latency = min(e["time"] for e in named) - hang["time"]
    assert 6.0 <= latency < 6.0 + 10.0, latency  # progress_timeout, plus a check interval
    assert started(run, 2)["resumed_from"] == 8
    print(f"\nhang: the watchdog ended the group {latency:.1f}s after rank 1 stopped progressing")
    _report(run, "hang")


def test_a_partitioned_rank_is_found_on_both_sides_and_the_run_recovers_bit_exactly(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = runs["partition"]
    assert_bitwise_equal(run, runs["reference"])
    events, cut = run["events"], run["cut"]["time"]
    found = {e["rank"]: e for e in events if e["event"] == "watchdog" and e["restart"] == 0}
    # The cut-off rank could not complete a read of the store: it fenced itself off and ended
    # with 88, within the heartbeat timeout (3 s) plus an interval (0.25 s) of the cut.
    isolated = found[1]
    assert "rank 1 could not reach the coordination store" in isolated["message"], found
    assert f"exit code {EXIT_ISOLATED}" in isolated["message"]
    # (Which exit the agent reports first, rank 1's 88 or rank 0's 86, is a race: the finding
    # each rank logged before its exit is what says what happened.)
    latency = isolated["time"] - cut
    assert latency <= 3.0 + 0.25 + 2.0, latency  # plus scheduling on a loaded machine
    # The healthy side found rank 1 dead (86) — unless the agent stopped it first, after rank
    # 1's exit: both are a restart.
    healthy = found.get(0)
    if healthy is not None:
        assert "rank 1 sent no heartbeat" in healthy["message"], healthy
        assert f"exit code {EXIT_PEER_DEAD}" in healthy["message"]
    print(
        f"\npartition: rank 1 isolated {latency:.2f}s after the cut; rank 0 "
        + (f"found it dead after {healthy['time'] - cut:.2f}s" if healthy else "was stopped")
    )
    # The restarted run resumed from a checkpoint committed before the cut ended anything, and
    # every committed checkpoint was written by a rank 0 (rank 1 never commits a manifest; the
    # fenced rank committed nothing).
    assert started(run, 1)["resumed_from"] is not None
    zeros = {e["pid"] for e in events if e["event"] == "started" and e["rank"] == 0}
    store = CheckpointStore(run["store"])
    try:
        assert store.verify().ok
        assert all(store.manifest(s).audit["pid"] in zeros for s in store.steps())
    finally:
        store.close()
