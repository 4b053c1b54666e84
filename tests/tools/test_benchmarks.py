"""Smoke test of the benchmark harness: the quick mode runs end to end and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, timeout: float = 300) -> str:
    """Run ``python -m <args>`` from the repository root; fail with its output if it fails,
    else return its standard output."""
    return _python("-m", *args, timeout=timeout)


def _python(*args: str, timeout: float) -> str:
    """``_bench`` with the interpreter's own ``args`` (``-m`` or ``-c``)."""
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_quick_benchmark_runs_and_reports(tmp_path: Path) -> None:
    _bench("benchmarks", "--quick", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "quick.json").read_text())
    assert {"cpu_count", "ram_bytes", "torch", "python"} <= set(doc["machine"])
    for when in ("start", "end"):
        assert doc["machine"][f"parallel_scaling_at_{when}"] > 0
    records = doc["records"]
    from benchmarks.harness.scenarios import SCENARIOS
    from benchmarks.harness.systems import SYSTEMS

    ran = {(r["scenario"], r["system"]) for r in records}
    assert ran == {(scenario, system) for scenario in SCENARIOS for system in SYSTEMS}, (
        "every system must run in every scenario"
    )
    for record in records:
        assert record["bytes_written"] > 0, record
    for record in records:
        for key, kind in (
            ("scenario", str),
            ("system", str),
            ("bytes_written", int),
            ("stall_s", float),
            ("save_s", float),
        ):
            assert isinstance(record[key], kind), (key, record)
        assert record["restore_s"] is None or isinstance(record["restore_s"], float)
    unchanged = [
        r for r in records if r["scenario"] == "unchanged" and r["system"] == "incremental"
    ]
    plain = [r for r in records if r["scenario"] == "unchanged" and r["system"] == "torch_save"]
    assert unchanged and plain
    # a save where nothing changed writes a manifest, not the state
    assert unchanged[-1]["bytes_written"] < 0.05 * plain[-1]["bytes_written"]
    assert (tmp_path / "quick.md").read_text().count("|") > 20


def test_parallel_scaling_is_measured_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.harness import machine
    from benchmarks.reports import side_by_side as report

    value = machine.parallel_scaling(work=200_000, processes=2)
    assert value is not None and 0 < value < 10
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert machine.parallel_scaling(work=1000) is None
    text = report._scaling({"cpu_available": 2, "parallel_scaling_at_start": 1.9})
    assert "did 1.90x one's work at the start of the run (" in text
    both = report._scaling(
        {"cpu_available": 2, "parallel_scaling_at_start": 1.9, "parallel_scaling_at_end": 1.2}
    )
    assert "1.90x one's work at the start of the run, 1.20x at its end" in both
    assert report._scaling({"cpu_available": 2}) == ""


@pytest.mark.slow
def test_replica_check_benchmark_runs_over_two_ranks(tmp_path: Path) -> None:
    stdout = _bench(
        "benchmarks.suites.replica_check", "--quick", "--repeats", "1",
        "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ranks"] == 2 and result["tensors"] > 10
    assert result["state_bytes"] > 1_000_000
    assert "check / training step" in stdout


@pytest.mark.slow
def test_restore_benchmark_runs_every_system(tmp_path: Path) -> None:
    _bench(
        "benchmarks.suites.restore", "--quick", "--repeats", "1", "--chains", "1", "2",
        "--dir", str(tmp_path / "r"), "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    systems = {(r["system"], r["chain"], r["cold"]) for r in rows}
    for cold in (False, True):
        assert {("torch", None, cold), ("torch_mmap", None, cold), ("dcp", None, cold)} <= systems
        for chain in (1, 2):
            assert {("ours", chain, cold), ("ours_into", chain, cold)} <= systems
    assert all(r["seconds"] > 0 for r in rows)


_PEAK_RSS = """
import gc
import numpy as np
from benchmarks.harness.memory import peak_extra_rss

held = np.ones(64 << 20, dtype=np.uint8)  # resident before the block: not extra
with peak_extra_rss() as peak:
    temporary = np.ones(96 << 20, dtype=np.uint8)
    del temporary
print(peak.extra_bytes)

gc.disable()
garbage = [np.ones(128 << 20, dtype=np.uint8)]
garbage.append(garbage)  # a cycle: freed only by a collection
del garbage
with peak_extra_rss() as peak:
    gc.collect()  # a collection inside the block frees 128 MB of earlier work
    temporary = np.ones(96 << 20, dtype=np.uint8)
    del temporary
print(peak.extra_bytes)
"""


def test_peak_rss_counts_memory_freed_before_the_block_ends() -> None:
    """The benchmarks' memory figure (``benchmarks.harness.memory``): the high-water mark of the
    block, so memory allocated, touched and freed inside it counts; memory held before it does
    not, and garbage of earlier work freed inside it does not hide the block's peak. In a
    fresh interpreter: another test's threads or garbage, freed during the block, would lower
    the resident memory under the start here."""
    out = _python("-c", _PEAK_RSS, timeout=120)
    plain, after_garbage = (int(line) for line in out.split())
    assert 90 << 20 <= plain < 150 << 20
    assert 90 << 20 <= after_garbage < 150 << 20


def test_analysis_compares_the_codecs_per_tensor_kind() -> None:
    from benchmarks.harness import analysis
    from benchmarks.reports import analysis as analysis_report

    g = torch.Generator().manual_seed(0)

    def state(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> dict:
        return {
            "state_dict": {"w": w},
            "optimizer_states": [{"state": {0: {"exp_avg": m, "exp_avg_sq": v}}}],
        }

    w, m, v = (torch.randn(1 << 16, generator=g) for _ in range(3))
    before = state(w, m, v.square())
    after = state(w + 1e-4 * torch.randn(w.shape, generator=g), 0.9 * m, 0.999 * v.square())
    rows = analysis.breakdown(before, after, chunk_size=1 << 16, level=1)
    assert {"weights", "exp_avg", "exp_avg_sq", "all"} <= set(rows)
    for name in ("weights", "exp_avg", "exp_avg_sq"):
        row = rows[name]
        assert row["changed_bytes"] == row["logical_bytes"] == 1 << 18
        for coder in ("before", "after"):
            assert row[coder]["ratio"] > 1.0 and row[coder]["encode_MBps"] > 0
        assert row["after"]["bytes"] <= row["before"]["bytes"] * 1.02
    whole = rows["all"]
    for key in ("encode_2t_MBps", "encode_2t_race_MBps", "encode_2t_hinted_MBps"):
        assert whole[key] > 0
    # the steady figure lies between racing every chunk and racing none
    low, high = sorted((whole["encode_2t_race_MBps"], whole["encode_2t_hinted_MBps"]))
    assert low <= whole["encode_2t_MBps"] <= high
    assert whole["decode_2t_MBps"] > 0
    table = analysis_report.markdown({"toy": rows})
    assert "before: ratio" in table and "| toy | weights |" in table
    assert "on 2 threads" in table


def test_the_codec_goal_reads_the_two_thread_figures() -> None:
    """The codec goal covers the dense scenarios of the analysis; another scenario's figures
    (a sparse one, far faster) do not count, and without an analysis it is not measured."""
    from benchmarks.reports import side_by_side as report

    def whole(encode: float, decode: float) -> dict:
        race = encode * 0.8
        return {
            "all": {"encode_2t_MBps": encode, "encode_2t_race_MBps": race, "decode_2t_MBps": decode}
        }

    def codec_goal(breakdowns: dict | None) -> report.Goal:
        return next(g for g in report.goals([], breakdowns) if g.name.startswith("the codec"))

    assert codec_goal(None).met is None
    assert codec_goal({"dense_fp32": whole(1200, 1600), "bf16": whole(1100, 1700)}).met
    slow = codec_goal({"dense_fp32": whole(1200, 1600), "bf16": whole(900, 1700)})
    assert slow.met is False and "bf16 900 (720) / 1700" in slow.measured
    assert codec_goal({"sparse_embedding": whole(1, 1)}).met is None


@pytest.mark.slow
def test_quality_and_durable_benchmarks_run(tmp_path: Path) -> None:
    for args in (
        [
            "benchmarks.suites.quality",
            "--layers",
            "1",
            "--dim",
            "32",
            "--every",
            "5",
            "--resume-at",
            "10",
            "--after",
            "10",
        ],
        # coded in full: under auto a disk faster than the codec gets chunks stored as they are
        ["benchmarks.suites.durable", "--sizes", "8", "--repeats", "1", "--interval", "2"]
        + ["--codec-effort", "full"],
    ):
        _bench(*args, "--out", str(tmp_path))
    quality = json.loads((tmp_path / "quality.json").read_text())
    assert quality["summary"]["exact"]["max_rel_diff"] == 0.0  # an exact resume is exact
    assert {"exact", "bf16", "int8"} < set(quality["summary"])
    durable = json.loads((tmp_path / "durable.json").read_text())[0]
    assert durable["fewer_bytes"] > 1.0 and durable["steady_efforts"] == ["full"]


@pytest.mark.slow
def test_sharded_and_codec_profile_benchmarks_run(tmp_path: Path) -> None:
    """The sharded benchmark (two torchrun launches: save, then restore resharded) and the
    codec profile end to end, on tiny states: they reach into the store's parts and the codec
    registry, which a refactoring can move."""
    _bench(
        "benchmarks.suites.sharded", "--mb", "4", "--checkpoints", "2", "--restores", "1",
        "--out", str(tmp_path), timeout=600,
    )  # fmt: skip
    report = json.loads((tmp_path / "sharded.json").read_text())
    assert report
    profile = tmp_path / "profile.md"
    _bench(
        "benchmarks.suites.codec_profile", "--quick", "--scenarios", "dense_fp32", "--chunks", "1",
        "--repeats", "1", "--markdown", str(profile), timeout=600,
    )  # fmt: skip
    assert "single-thread MB/s" in profile.read_text()


@pytest.mark.slow
def test_goodput_benchmark_counts_saves_and_reports_overheads(tmp_path: Path) -> None:
    import math

    _bench(
        "benchmarks.suites.goodput", "--quick", "--systems", "none,callback,modelcheckpoint",
        "--intervals", "5", "--regimes", "free", "--workloads", "lightning",
        "--out", str(tmp_path), timeout=240,
    )  # fmt: skip
    doc = json.loads((tmp_path / "goodput.json").read_text())
    assert {"cpu_count", "torch", "git_commit"} <= set(doc["machine"])
    assert doc["settings"]["intervals"] == {"free": [5]}
    runs = doc["runs"]
    assert sorted(r["system"] for r in runs) == ["callback", "modelcheckpoint", "none"]
    for run in runs:
        assert "error" not in run, run
        assert (run["workload"], run["regime"], run["interval"]) == ("lightning", "free", 5)
        assert run["torch_threads"] == 1  # a core left free
        total = run["warmup"] + run["steps"]
        due = [s for s in range(1, total + 1) if s % 5 == 0]
        if run["system"] == "none":
            assert run["saves_total"] == 0 and run["restore_s"] is None
            continue
        # every save due was made, at its step, none more (no extra save at the end)
        assert run["saved_steps"] == due, run
        assert run["saves"] == sum(1 for s in due if s > run["warmup"]) > 0
        assert run["bytes_on_disk"] > 0 and run["restore_s"] > 0
    (cell,) = doc["summary"]["cells"]
    for system in ("callback", "modelcheckpoint"):
        figures = cell["systems"][system]
        assert math.isfinite(figures["overhead"]) and math.isfinite(figures["lost_work_s"])
    goals = doc["summary"]["goals"]
    assert len(goals) == 3 and all(g["met"] is None for g in goals)  # no such cell ran
    text = (tmp_path / "goodput.md").read_text()
    assert "| callback |" in text and "| modelcheckpoint |" in text and "## Goals" in text
    assert "a core free, every 5" in text


@pytest.mark.slow
def test_memory_restore_benchmark_reads_own_memory_and_a_peers(tmp_path: Path) -> None:
    """The memory tier's restore benchmark: a resume from this node's memory and one from the
    other node's (two gloo processes), each beside its baseline."""
    _bench(
        "benchmarks.suites.memory_restore", "--mb", "8", "--repeats", "2", "--out", str(tmp_path)
    )
    doc = json.loads((tmp_path / "memory_restore.json").read_text())
    own, peer = doc["own"], doc["peer"]
    assert own["part_bytes"] >= 8 << 20 and peer["part_bytes"] >= 8 << 20
    assert own["memory_s"] > 0 and own["torch_load_s"] > 0
    assert peer["resume_s"] > 0 and peer["gloo_send_s"] > 0 and len(peer["rounds"]) == 2
    table = (tmp_path / "memory_restore.md").read_text()
    assert "own node's memory" in table and "from a peer" in table
