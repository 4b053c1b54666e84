"""``python -m benchmarks``: run the scenarios against every system, write JSON and Markdown."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import machine
from benchmarks.harness.model import (
    FULL,
    FULL_EMBEDDING,
    QUICK,
    QUICK_EMBEDDING,
    EmbeddingConfig,
    ModelConfig,
)
from benchmarks.harness.runner import RunSettings, run_scenario
from benchmarks.harness.scenarios import SCENARIOS, Params
from benchmarks.harness.systems import SYSTEMS
from benchmarks.reports import analysis
from benchmarks.reports import side_by_side as report
from benchmarks.reports import side_by_side_plot as plot

MODES: dict[str, tuple[ModelConfig, EmbeddingConfig, int, int]] = {
    # mode: (transformer, sparse_embedding model, checkpoints, interval)
    "full": (FULL, FULL_EMBEDDING, 6, 10),
    "quick": (QUICK, QUICK_EMBEDDING, 3, 10),
}


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key, parsed


def _names(text: str, known: dict[str, Any], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; known: {sorted(known)}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Checkpoint bytes, stall, save and restore time of lightning-incremental "
        "against torch.save and Lightning's AsyncCheckpointIO on the same states.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few-MB model, 3 checkpoints: a smoke test (well under 2 minutes)",
    )
    p.add_argument(
        "--scenarios",
        type=lambda t: _names(t, SCENARIOS, "scenario"),
        default=list(SCENARIOS),
        help=f"comma-separated; default all: {','.join(SCENARIOS)}",
    )
    p.add_argument(
        "--systems",
        type=lambda t: _names(t, SYSTEMS, "system"),
        default=list(SYSTEMS),
        help=f"comma-separated; default all: {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--checkpoints", type=int, help="checkpoints per scenario (default: full 6, quick 3)"
    )
    p.add_argument("--interval", type=int, help="training steps between checkpoints (10)")
    p.add_argument(
        "--store-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a StoreConfig option for the incremental system, "
        "e.g. chunk_size=1048576 (repeatable)",
    )
    p.add_argument(
        "--restore",
        choices=("every", "last"),
        default="every",
        help="restore after every checkpoint or after the last only",
    )
    p.add_argument(
        "--analyze",
        action="store_true",
        help="also break the last checkpoint's bytes down by tensor kind "
        "(weights, exp_avg, exp_avg_sq) with the engine's codec",
    )
    p.add_argument(
        "--train-threads",
        type=int,
        default=1,
        help="torch threads while training between checkpoints (0: torch's default); saves "
        "and restores always use torch's default (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lr",
        type=float,
        default=Params.lr,
        help=f"AdamW learning rate, constant (default {Params.lr})",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="output directory; checkpoints are written under it (default bench_out/)",
    )
    p.add_argument("--json", type=Path, help="results JSON (default OUT/{full,quick}.json)")
    p.add_argument("--markdown", type=Path, help="Markdown report (default OUT/{full,quick}.md)")
    p.add_argument("--png", type=Path, help="figure (default: next to the JSON, same name, .png)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--list", action="store_true", help="list scenarios and systems, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"scenario {s.name:12s} {s.description}")
        for name, cls in SYSTEMS.items():
            print(f"system   {name:16s} {cls.summary}")
        return 0
    mode = "quick" if args.quick else "full"
    model, embedding, checkpoints, interval = MODES[mode]
    settings = RunSettings(
        params=Params(
            model=model,
            embedding=embedding,
            seed=args.seed,
            lr=args.lr,
            interval=args.interval if args.interval is not None else interval,
        ),
        checkpoints=args.checkpoints or checkpoints,
        systems=args.systems,
        store_options=dict(args.store_option),
        restore_every=args.restore == "every",
        analyze=args.analyze,
        workdir=args.out / "work",
        keep=args.keep,
        train_threads=args.train_threads,
    )
    json_path = args.json or args.out / f"{mode}.json"
    md_path = args.markdown or args.out / f"{mode}.md"
    png_path = args.png or json_path.with_suffix(".png")
    info = machine.describe()
    info["run"] = {
        "mode": mode,
        "checkpoints": settings.checkpoints,
        "interval": settings.params.interval,
        "lr": settings.params.lr,
        "weight_decay": settings.params.weight_decay,
        "model": model.as_dict(),
        "embedding_model": embedding.as_dict(),
        "scenarios": args.scenarios,
        "systems": args.systems,
        "store_options": settings.store_options,
        "restore": args.restore,
        "seed": args.seed,
        "train_threads": args.train_threads,
        "torch_threads": torch.get_num_threads(),
    }
    info["loadavg_at_start"] = list(os.getloadavg())
    info["parallel_scaling_at_start"] = machine.parallel_scaling()
    records: list[dict[str, Any]] = []
    breakdowns: dict[str, Any] = {}
    started = time.perf_counter()
    for name in args.scenarios:
        recs, breakdown = run_scenario(SCENARIOS[name], settings)
        records.extend(recs)
        if breakdown is not None:
            breakdowns[name] = breakdown
        info["run"]["wall_s"] = time.perf_counter() - started
        _write(json_path, {"machine": info, "records": records})
    info["parallel_scaling_at_end"] = machine.parallel_scaling()
    _write(json_path, {"machine": info, "records": records})
    if breakdowns:
        _write(json_path.with_name(json_path.stem + ".analysis.json"), breakdowns)
    rows = report.summarize(records)
    text = report.markdown(
        info,
        records,
        rows,
        report.goals(rows, breakdowns),
        analysis.markdown(breakdowns) if breakdowns else None,
        {name: cls.summary for name, cls in SYSTEMS.items()},
    )
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    print(text)
    written = [json_path, md_path]
    try:
        title = (
            f"{mode} mode: {settings.checkpoints} checkpoints every {settings.params.interval} "
            f"steps; {info['cpu_available']} CPUs ({info['cpu_model']}), shared, load "
            f"{report.load_range(records)}; lower is better in every panel"
        )
        plot.write_png(records, png_path, title)
        written.append(png_path)
    except ImportError:
        print("no figure: matplotlib is not installed (pip install '.[bench]')", file=sys.stderr)
    print(
        f"wrote {', '.join(map(str, written))} in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )
    wrong = [r for r in records if r["restore_ok"] is False]
    if wrong:
        print(f"{len(wrong)} restore(s) returned a different state", file=sys.stderr)
        return 1
    return 0


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(path)
