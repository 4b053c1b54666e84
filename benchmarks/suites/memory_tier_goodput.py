"""The memory tier's training-time overhead: memory every step plus the persistent store every
50 steps, against no checkpointing (and the store every 50 alone), in one interleaved run.

``python -m benchmarks.suites.memory_tier_goodput [--quick] [--out DIR] [--repeats N]``. The
harness is the goodput benchmark's (``goodput.py``, ``goodput_jobs.py``): every (workload,
system, regime) is a job (``memory_tier_jobs.py``) in a fresh process that trains the benchmark
LM (FULL: 17.4 M parameters, ~209 MB of fp32 + AdamW state) on random tokens for ``warmup``
untimed steps (one memory step and nothing in flight when the clock starts) and then ``steps``
timed steps (default 50: 50 memory steps and one store save, at step 50). The two CPU regimes
are the goodput benchmark's: *all cores* trains with torch's default threads, *a core free*
with one (``torch.set_num_threads(1)``), leaving the other core to the background work.
Overhead = (T_system - T_none) / T_none, T_none measured in the same run, each figure the best
of ``repeats`` jobs run in a rotating order.

Systems: ``none``; ``store50`` (``IncrementalCheckpoint`` / ``IncrementalCheckpointer`` every 50
steps); ``memory`` (the same, plus ``memory_every_n_train_steps=1`` / ``memory_every_n_steps=1``,
one replica: on one node nothing is sent); with ``--before DIR`` (another checkout of the
project, holding this file, or ``benchmarks/memory_tier_goodput.py`` in a checkout from before
the benchmarks were sorted into folders), ``memory_before``: ``memory`` run from that checkout,
in the same rotation, so that a before/after comparison on a shared machine sees the same load.

Memory, sampled every 20 ms by a thread of the job: the process's anonymous resident memory
(``RssAnon``) plus the bytes the job's memory directory (a tmpfs under ``/dev/shm``) holds; the
node's extra host memory is its peak minus the peak ``RssAnon`` of ``none``, as a multiple of
``S``, the size of one part (``data.bin``). Bytes per step to a replica: the three files of one
part, what the exchange sends to each of ``memory_replicas`` other nodes (computed from the
part; a one-node job sends nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.job_process import run_job as in_process
from benchmarks.suites.memory_tier_jobs import STORE_EVERY, run_job

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("none", "store50", "memory")
BEFORE = "memory_before"  # ``memory`` from the checkout given by --before
REGIMES = ("all", "free")
JOB_TIMEOUT_S = 900


def job_module(root: Path) -> str:
    """The module that runs a job in the checkout ``root``: this one, or where it was before the
    benchmarks were sorted into folders (a ``--before`` checkout may be that old)."""
    if (root / "benchmarks" / "memory_tier_goodput.py").is_file():
        return "benchmarks.memory_tier_goodput"
    return "benchmarks.suites.memory_tier_goodput"


def run_one(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    job_dir = Path(tempfile.mkdtemp(prefix="memory-goodput-", dir=work))
    spec = {**spec, "dir": str(job_dir), "result": str(job_dir / "result.json")}
    root = Path(spec.get("root") or ROOT)
    # the checkout before runs its memory tier under this module's job
    job = {**spec, "system": "memory"} if spec["system"] == BEFORE else spec
    try:
        record = in_process(job_module(root), job, root, JOB_TIMEOUT_S)
        return {**record, "system": spec["system"]}
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every job, in run order: per repeat, per (workload, regime), the systems rotated by one."""
    specs = []
    cells = [(w, r) for w in args.workloads for r in args.regimes]
    for repeat in range(args.repeats):
        for index, (workload, regime) in enumerate(cells):
            systems = args.systems
            shift = (repeat + index) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                specs.append(
                    {
                        "workload": workload,
                        "system": system,
                        "regime": regime,
                        "warmup": args.warmup,
                        "steps": args.steps,
                        "quick": bool(args.quick),
                        "repeat": repeat,
                        "memory_root": args.memory_root,
                        "root": args.before if system == BEFORE else None,
                    }
                )
    return specs


REGIME_NAMES = {"all": "all cores", "free": "a core free"}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (workload, regime): each system's best time, its overhead against ``none``, and the
    memory figures of the memory tier's best job."""
    out: dict[str, Any] = {}
    ok = [r for r in records if "error" not in r]
    for workload in sorted({r["workload"] for r in ok}):
        for regime in REGIMES:
            cell = [r for r in ok if r["workload"] == workload and r["regime"] == regime]
            best = {}
            for system in (*SYSTEMS, BEFORE):
                mine = [r for r in cell if r["system"] == system]
                if mine:
                    best[system] = min(mine, key=lambda r: r["timed_s"])
            if "none" not in best:
                continue
            base = best["none"]
            entry: dict[str, Any] = {
                "step_s": {s: r["step_s"] for s, r in best.items()},
                "overhead": {
                    s: r["timed_s"] / base["timed_s"] - 1 for s, r in best.items() if s != "none"
                },
                "jobs": {s: sum(1 for r in cell if r["system"] == s) for s in best},
            }
            none_anon = min(r["peak_rss_anon"] for r in cell if r["system"] == "none")
            for system in ("memory", BEFORE):
                mem = best.get(system)
                if mem is None or not mem.get("part_files"):
                    continue
                part = mem["part_files"]
                size = part.get("data.bin", 0)
                entry.setdefault("memory_figures", {})[system] = {
                    "part_bytes": sum(part.values()),
                    "state_bytes": size,
                    "node_extra_bytes": mem["peak_node"] - none_anon,
                    "node_extra_x_state": (mem["peak_node"] - none_anon) / size,
                    "tmpfs_peak_x_state": mem["peak_tmpfs"] / size,
                    "anon_extra_x_state": (mem["peak_rss_anon"] - none_anon) / size,
                }
            out[f"{workload} {regime}"] = entry
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f} %"


def markdown(doc: dict[str, Any]) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = [
        "# The memory tier's training-time overhead",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_available']} CPUs, {m['ram_gib']} GiB; torch "
        f"{m['torch']}, lightning {m['lightning']}, accelerate {m['accelerate']} (commit "
        f"{(m['git_commit'] or '?')[:10]}). Load average at the start "
        f"{s['loadavg_start'][0]:.2f}, at the end {s['loadavg_end'][0]:.2f}; the run took "
        f"{s['elapsed_s'] / 60:.1f} min. {s.get('note', '')}",
        "",
        f"Model {s['model']}; {s['warmup']} untimed steps, then {s['steps']} timed steps "
        f"(the memory tier every step, the store every {STORE_EVERY}); best of "
        f"{s['repeats']} jobs per figure, the systems in a rotating order. Overhead = "
        "(T - T_none) / T_none in the same cell. *All cores*: torch's default threads; "
        "*a core free*: one thread. `memory_before`: the memory tier of the checkout "
        f"{s.get('before_commit') or '-'}, run in the same rotation.",
        "",
        "| workload | regime | none s/step | store every 50 | memory every step + store every "
        "50, before | memory every step + store every 50 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for key, e in doc["summary"].items():
        workload, regime = key.split()
        o = e["overhead"]
        lines.append(
            f"| {workload} | {REGIME_NAMES[regime]} | {e['step_s']['none']:.3f} | "
            f"{_pct(o.get('store50'))} | {_pct(o.get(BEFORE))} | {_pct(o.get('memory'))} |"
        )
    lines += [
        "",
        "Host memory of the memory job's node beyond `none`'s (peak of anonymous resident memory "
        "+ the memory directory's tmpfs bytes, sampled every 20 ms), in multiples of S, one "
        "part's `data.bin`; bytes a step sends to each replica (a part's three files):",
        "",
        "| workload | regime | system | S (MB) | node extra | tmpfs peak | anon extra | "
        "to each replica per step (MB) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, e in doc["summary"].items():
        workload, regime = key.split()
        for system, f in e.get("memory_figures", {}).items():
            lines.append(
                f"| {workload} | {REGIME_NAMES[regime]} | {system} | "
                f"{f['state_bytes'] / 1e6:.1f} | {f['node_extra_x_state']:.2f} S | "
                f"{f['tmpfs_peak_x_state']:.2f} S | {f['anon_extra_x_state']:.2f} S | "
                f"{f['part_bytes'] / 1e6:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _commit(path: str) -> str | None:
    out = subprocess.run(
        ["git", "-C", path, "rev-parse", "--short=10", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.memory_tier_goodput")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the ~6 MB QUICK model")
    parser.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    parser.add_argument("--workloads", default="lightning,accelerate")
    parser.add_argument("--regimes", default="all,free")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="none is always run")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per figure, best taken")
    parser.add_argument("--steps", type=int, default=STORE_EVERY, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--memory-root", default="/dev/shm", help="tmpfs for the memory tier")
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. the load)")
    parser.add_argument("--before", help="another checkout: also run its memory tier")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.regimes = [r for r in args.regimes.split(",") if r]
    args.systems = ["none", *(s for s in args.systems.split(",") if s and s != "none")]
    if args.before:
        args.systems.append(BEFORE)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.job is not None:
        spec = json.loads(args.job)
        Path(spec["result"]).write_text(json.dumps(run_job(spec)))
        return
    from benchmarks.harness.machine import describe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = plan(args)
    settings: dict[str, Any] = {
        "model": "QUICK" if args.quick else "FULL",
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "note": args.note,
        "before_commit": _commit(args.before) if args.before else None,
        "loadavg_start": os.getloadavg(),
    }
    print(f"memory tier goodput: {len(specs)} jobs", flush=True)
    records, started = [], time.perf_counter()
    work = Path(tempfile.gettempdir())
    for n, spec in enumerate(specs, 1):
        record = run_one(spec, work)
        records.append(record)
        label = f"{spec['workload']} {spec['regime']} {spec['system']}"
        if "error" in record:
            print(f"[{n}/{len(specs)}] {label}: FAILED {record['error']}", flush=True)
        else:
            print(
                f"[{n}/{len(specs)}] {label}: {record['step_s']:.3f} s/step; "
                f"run {time.perf_counter() - started:.0f} s",
                flush=True,
            )
    settings["loadavg_end"] = os.getloadavg()
    settings["elapsed_s"] = time.perf_counter() - started
    doc = {"machine": describe(), "settings": settings, "summary": summarize(records)}
    doc["runs"] = records
    (out / "memory_tier_goodput.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    (out / "memory_tier_goodput.md").write_text(text)
    print(text)
    if any("error" in r for r in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
