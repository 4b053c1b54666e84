"""Goodput: the training throughput that checkpointing costs, for our callback, plug-in and
Accelerate checkpointer against what users checkpoint with today, in one interleaved run.

``python -m benchmarks.suites.goodput [--quick] [--out DIR]``. Every (workload, system, regime,
interval) is a job in a fresh process (``--job``, see ``goodput_jobs.py``) that trains the
benchmark LM (FULL: 17.4 M parameters, ~209 MB of fp32 + AdamW state) on random tokens for a
few warm-up steps and then ``steps`` timed steps, checkpointing every ``interval`` steps into
a temporary directory on local disk (removed after the job). The time is wall clock from after
the warm-up (nothing in flight) to the end of training with every checkpoint durable. Overhead
= (T_system - T_none) / T_none, per workload, regime and interval, T_none measured in the same
run; each figure is the best of ``repeats`` jobs, run in a rotating order within each
(workload, regime, interval) so that a slow spell of a shared machine hits every system alike.

Default length (FULL model, an idle 2-core machine, target <= 25 min). A job spends ~5 s
outside its timed window (interpreter and imports, model, warm-up, restore, clean-up; with
saves at every step, 2 more untimed saves); a training step takes ~0.33 s on both cores and
~0.55 s on one thread; a save adds ~0.5-1.5 s (saves at every step queue behind each other:
those jobs run at the pace of the saves). Timed steps: 5 at every step (5 saves), 20 at every
10 (2 saves), 50 at every 50 (1 save), 150 for ``callback_budget``. The every-50 column runs on
all cores only: with a core free it would add ~4 min (13 jobs of 50 one-thread steps) for the
column that says least (one save per job, an overhead about the size of the noise);
``--intervals 1,10,50`` runs it in every regime. The Lightning cells the goals read (all cores
every 10 steps, a core free every step and every 10) run twice, best of 2; every other cell,
and the Accelerate loop, once. 79 jobs: summing, per job, ~5 s + its timed steps at the step
times above + its saves at ~1-1.5 s gives ~22-23 min (Lightning ~17, Accelerate ~5).
``--steps`` and ``--repeats`` override.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.job_process import run_job
from benchmarks.suites import goodput_jobs as jobs

ROOT = Path(__file__).resolve().parents[2]
REGIMES = ("all", "free")
# intervals per regime without --intervals (see the docstring: a core free every 50 steps would
# cost ~4 min for one save per job)
INTERVALS = {"all": (1, 10, 50), "free": (1, 10)}
QUICK_INTERVALS = (10,)  # --quick: one interval, so that it stays within ~3 min
# timed steps per (regime, interval); an interval not listed gets 2 intervals' worth
STEPS_FULL = {("all", 1): 5, ("all", 10): 20, ("all", 50): 50}
STEPS_FULL |= {("free", 1): 5, ("free", 10): 20, ("free", 50): 50}
ADAPTIVE_STEPS = 150  # the budgeted callback: long enough for its measured interval to show
# without --repeats, the Lightning cells the goals read run twice, every other cell once
GOAL_CELLS = {("all", 10), ("free", 1), ("free", 10)}
WARMUP = 2
QUICK_STEPS = 10  # timed steps per job with --quick (at least one interval's worth)
JOB_TIMEOUT_S = 900


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suites.goodput",
        description="Lost training throughput of checkpointing, against today's systems.",
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the ~6 MB QUICK model, few steps")
    parser.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    parser.add_argument("--workloads", default="lightning,accelerate", help="lightning,accelerate")
    parser.add_argument("--systems", help="comma-separated (default: every one of the workload)")
    parser.add_argument("--regimes", default=",".join(REGIMES), help="all (both cores), free")
    parser.add_argument(
        "--intervals",
        help="in steps, for every regime (default: all 1,10,50, free 1,10; with --quick 10)",
    )
    parser.add_argument("--repeats", type=int, help="jobs per figure, best taken (default 2/1)")
    parser.add_argument("--steps", type=int, help="timed steps of every job (default: per cell)")
    parser.add_argument(
        "--warmup",
        type=int,
        help=f"untimed steps first (default: {WARMUP}, and one save first at every 1 and 10 steps)",
    )
    parser.add_argument("--mtbf-hours", type=float, default=4.0, help="for Young/Daly (4 h)")
    parser.add_argument("--work-dir", help="where jobs write checkpoints (default: the temp dir)")
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="train on the CPU or one GPU"
    )
    args = parser.parse_args(argv)
    if args.job is None:
        args.workloads = _csv(args.workloads)
        for workload in args.workloads:
            if workload not in jobs.WORKLOADS:
                parser.error(f"unknown workload {workload!r}: {', '.join(jobs.WORKLOADS)}")
        args.regimes = _csv(args.regimes)
        if not args.regimes or set(args.regimes) - set(REGIMES):
            parser.error(f"--regimes: {', '.join(REGIMES)}")
        if args.intervals is not None:
            given = tuple(int(i) for i in _csv(args.intervals))
            if not given or min(given) < 1:
                parser.error("--intervals: positive step counts")
        args.intervals = {
            regime: given
            if args.intervals is not None
            else QUICK_INTERVALS
            if args.quick
            else INTERVALS[regime]
            for regime in args.regimes
        }
        known = {s for systems in jobs.WORKLOADS.values() for s in systems}
        args.systems = _csv(args.systems) if args.systems else None
        for name in args.systems or []:
            if name not in known:
                parser.error(f"unknown system {name!r}: {', '.join(sorted(known))}")
        bad_warmup = args.warmup is not None and args.warmup < 1
        if bad_warmup or (args.steps is not None and args.steps < 1):
            parser.error("--warmup and --steps must be positive")
    return args


def steps_for(args: argparse.Namespace, regime: str, interval: int | None) -> int:
    """Timed steps of a job: ``--steps``, else the defaults above."""
    if args.steps is not None:
        return int(args.steps)
    if interval is None:
        return QUICK_STEPS if args.quick else ADAPTIVE_STEPS
    if args.quick:
        return max(QUICK_STEPS, interval)
    return STEPS_FULL.get((regime, interval), 2 * interval)


def systems_of(args: argparse.Namespace, workload: str) -> tuple[list[str], dict[str, str]]:
    """The systems to run for ``workload`` (``none`` always first) and those skipped, why."""
    wanted = [s for s in jobs.WORKLOADS[workload] if args.systems is None or s in args.systems]
    skipped = {s: why for s in wanted if (why := jobs.unavailable(s)) is not None}
    chosen = [s for s in wanted if s not in skipped]
    if chosen and "none" not in chosen:
        chosen.insert(0, "none")  # the baseline every overhead is measured against
    return chosen, skipped


def warmup_for(args: argparse.Namespace, interval: int | None) -> int:
    """Untimed steps before the clock starts: ``--warmup``, else enough for one save first where
    saves are frequent (every 1 or 10 steps), so that the timed saves are steady-state ones (an
    incremental store's first save is a full one, with no delta base yet), else ``WARMUP``."""
    if args.warmup is not None:
        return int(args.warmup)
    if interval is not None and interval <= 10:
        return interval + WARMUP
    return WARMUP


def repeats_of(args: argparse.Namespace, workload: str, regime: str, interval: int | None) -> int:
    """Jobs per figure: ``--repeats``, else 2 for the Lightning cells the goals read, 1
    otherwise (and with ``--quick``)."""
    if args.repeats is not None:
        return max(1, int(args.repeats))
    if args.quick or workload != "lightning" or (regime, interval) not in GOAL_CELLS:
        return 1
    return 2


def plan(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """Every job spec, in run order: for each repeat, each (workload, regime, interval) cell
    runs its systems back to back, in an order rotated by one at every repeat (and cell)."""
    cells: list[tuple[str, str, int | None, list[str]]] = []
    skipped: dict[str, dict[str, str]] = {}
    for workload in args.workloads:
        systems, skipped[workload] = systems_of(args, workload)
        fixed = [s for s in systems if s not in jobs.ADAPTIVE]
        adaptive = [s for s in systems if s in jobs.ADAPTIVE]
        for regime in args.regimes:
            for interval in args.intervals[regime]:
                cells.append((workload, regime, interval, fixed))
            if adaptive:  # its own interval: once per regime
                steps = steps_for(args, regime, None)
                # against the none of a cell of as many steps, else one of its own
                shared = any(steps_for(args, regime, i) == steps for i in args.intervals[regime])
                cells.append((workload, regime, None, adaptive if shared else ["none", *adaptive]))
    specs: list[dict[str, Any]] = []
    most = max((repeats_of(args, *c[:3]) for c in cells), default=0)
    for repeat in range(most):
        for index, (workload, regime, interval, systems) in enumerate(cells):
            if repeat >= repeats_of(args, workload, regime, interval) or not systems:
                continue
            shift = (repeat + index) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                specs.append(
                    {
                        "workload": workload,
                        "system": system,
                        "regime": regime,
                        "interval": interval,
                        "steps": steps_for(args, regime, interval),
                        "warmup": warmup_for(args, interval),
                        "quick": bool(args.quick),
                        "repeat": repeat,
                        "device": args.device,
                    }
                )
    return specs, skipped


def run_one(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one job in a fresh process; its record, or one with ``error``."""
    job_dir = Path(tempfile.mkdtemp(prefix="goodput-", dir=work))
    spec = {**spec, "dir": str(job_dir / "ckpt"), "result": str(job_dir / "result.json")}
    started = time.perf_counter()
    try:
        record = run_job("benchmarks.suites.goodput", spec, ROOT, JOB_TIMEOUT_S)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    record.pop("dir", None)
    record.pop("result", None)
    record["job_s"] = time.perf_counter() - started
    return record


def _label(spec: dict[str, Any]) -> str:
    k = spec["interval"]
    every = "auto" if k is None else f"k={k}"
    return f"{spec['workload']} {spec['regime']} {every} {spec['system']}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.job is not None:
        jobs.job_main(args.job)
        return
    from benchmarks.harness.machine import describe
    from benchmarks.reports import goodput as report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs, skipped = plan(args)
    for workload, why in skipped.items():
        for system, reason in why.items():
            print(f"note: {workload} {system} skipped: {reason}", flush=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir())
    work.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": "QUICK" if args.quick else "FULL",
        "workloads": args.workloads,
        "regimes": args.regimes,
        "intervals": args.intervals,
        "repeats": {
            f"{w} {r} {'auto' if i is None else i}": repeats_of(args, w, r, i)
            for w in args.workloads
            for r in args.regimes
            for i in [*args.intervals[r], None]
        },
        "warmup": args.warmup if args.warmup is not None else "per cell",
        "mtbf_hours": args.mtbf_hours,
        "work_dir": str(work),
        "skipped": skipped,
        "loadavg_start": os.getloadavg(),
    }
    print(f"goodput: {len(specs)} jobs, checkpoints under {work}", flush=True)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for n, spec in enumerate(specs, 1):
        record = run_one(spec, work)
        records.append(record)
        if "error" in record:
            print(f"[{n}/{len(specs)}] {_label(spec)}: FAILED {record['error']}", flush=True)
            continue
        print(
            f"[{n}/{len(specs)}] {_label(spec)} (repeat {spec['repeat'] + 1}): "
            f"{record['timed_s']:.2f} s for {record['steps']} steps "
            f"({record['step_s']:.3f} s/step), {record['saves']} saves in the window; "
            f"job {record['job_s']:.0f} s, run {time.perf_counter() - started:.0f} s",
            flush=True,
        )
    settings["loadavg_end"] = os.getloadavg()
    settings["elapsed_s"] = time.perf_counter() - started
    summary = report.summarize(records, args.mtbf_hours)
    doc = {"machine": describe(), "settings": settings, "summary": summary, "runs": records}
    (out / "goodput.json").write_text(json.dumps(doc, indent=1))
    text = report.markdown(doc)
    (out / "goodput.md").write_text(text)
    try:
        from benchmarks.reports import goodput_plot

        goodput_plot.write_png(summary, out / "goodput.png")
    except ImportError:
        print("note: matplotlib is not installed; goodput.png skipped", flush=True)
    print(text)
    print(f"wrote {out / 'goodput.json'}, {out / 'goodput.md'}", flush=True)
    if any("error" in r for r in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
