"""The scale benchmark's command: its options, the sweeps run in a scratch directory, the rows
of the sweeps not run kept from the results already there (``--results``), the outputs."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import benchmarks.suites.scale as package
from benchmarks.harness.machine import describe, parallel_scaling
from benchmarks.suites.scale.big import big_sweep
from benchmarks.suites.scale.measure import child
from benchmarks.suites.scale.tensors import tensors_sweep

RESULTS = Path(__file__).parents[2] / "results"
DOCS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "scale.md"


def ranks_sweep(ranks: tuple[int, ...]) -> tuple[list[dict[str, Any]], str | None]:
    """The simulated many-ranks records, or a note why there are none."""
    try:
        module = importlib.import_module("benchmarks.suites.scale.ranks")
    except ModuleNotFoundError as error:
        if error.name != "benchmarks.suites.scale.ranks":
            raise
        return [], "many ranks: skipped, benchmarks/suites/scale/ranks.py is not in this checkout"
    rows = [dict(r) for r in module.run(ranks=ranks)]
    for r in rows:
        r.setdefault("sweep", "ranks")
    return rows, None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v.replace("_", "")) for v in text.split(",") if v.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suites.scale",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="500 and 2,000 tensors, a 64 MB state, 16 and 256 ranks; 1 repeat",
    )
    p.add_argument("--tensors", type=_ints, default=None, help="e.g. 2000,20000,100000")
    p.add_argument("--big-gb", type=_floats, default=None, help="state sizes in GB, e.g. 1,4")
    p.add_argument("--ranks", type=_ints, default=None, help="simulated ranks, e.g. 16,256,4096")
    p.add_argument("--sweeps", default="tensors,big,ranks", help="which sweeps to run")
    p.add_argument("--repeats", type=int, default=None, help="best of (default 3, quick 1)")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (a local disk)")
    p.add_argument("--out", type=Path, default=Path("bench_out/scale"))
    p.add_argument(
        "--results",
        action="store_true",
        help="write benchmarks/results/scale.* and regenerate docs/guides/scale.md",
    )
    p.add_argument("--child", choices=["ours", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.tensors = args.tensors or ((500, 2000) if quick else (2000, 20000))
    args.big_gb = args.big_gb or ((0.064,) if quick else (1.0,))
    args.ranks = args.ranks or ((16, 256) if quick else (16, 256, 4096))
    if args.repeats is None:
        args.repeats = 1 if quick else 3
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.sweeps = {s.strip() for s in args.sweeps.split(",") if s.strip()}
    unknown = args.sweeps - {"tensors", "big", "ranks"}
    if unknown:
        p.error(f"unknown sweeps {sorted(unknown)}: choose from tensors, big, ranks")
    if args.results:
        args.out = RESULTS
    return args


SWEEPS = ("tensors", "big", "ranks")
_SETTINGS = {"tensors": ("tensors",), "big": ("big_gb",), "ranks": ("ranks",)}
_KEPT = re.compile(
    r"the rows of (?P<sweeps>[a-z, ]+) are kept from the run of commit (?P<commit>\S+)"
)


def keep_other_sweeps(
    previous: Path,
    ran: set[str],
    records: list[dict[str, Any]],
    notes: list[str],
    settings: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """With ``--results`` for some of the sweeps: the rows of the others kept from the results
    already there (``previous``), with a note naming the run they come from."""
    if not previous.is_file():
        return records, notes, settings
    before = json.loads(previous.read_text())
    kept = [r for r in before.get("records", []) if r.get("sweep") not in ran]
    if not kept:
        return records, notes, settings
    names = sorted({r["sweep"] for r in kept}, key=SWEEPS.index)
    commit = str(before.get("machine", {}).get("git_commit"))[:10]
    origin = {sweep: commit for sweep in names}  # rows the previous run kept keep their origin
    for note in before.get("notes", []):
        found = _KEPT.fullmatch(note)
        if found:
            for sweep in found["sweeps"].split(", "):
                if sweep in origin:
                    origin[sweep] = found["commit"]
    merged = {**before.get("settings", {}), **settings}
    for sweep in names:
        for key in _SETTINGS[sweep]:
            merged[key] = before.get("settings", {}).get(key)
    kept_notes = [
        f"the rows of {', '.join(s for s in names if origin[s] == c)} are kept from the run of "
        f"commit {c}"
        for c in dict.fromkeys(origin[s] for s in names)
    ]
    old_notes = [n for n in before.get("notes", []) if "kept from the run" not in n]
    order = {sweep: i for i, sweep in enumerate(SWEEPS)}
    rows = sorted([*records, *kept], key=lambda r: order.get(r.get("sweep", ""), len(order)))
    return rows, [*notes, *old_notes, *kept_notes], merged


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(args.child, args.path, args.step)
        return 0
    from benchmarks.reports.scale import update_docs, write_outputs

    machine = {**describe(), "parallel_scaling": parallel_scaling()}
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="li-scale-") as tmp:
        root = Path(tmp)
        if "tensors" in args.sweeps:
            for n in args.tensors:
                records += tensors_sweep(n, root, args.repeats)
                print(f"tensors {n}: done at {time.perf_counter() - started:.0f} s", flush=True)
        if "big" in args.sweeps:
            for gb in args.big_gb:
                records += big_sweep(int(gb * 1e9), root, args.repeats)
                print(f"big {gb} GB: done at {time.perf_counter() - started:.0f} s", flush=True)
    if "ranks" in args.sweeps:
        rows, note = ranks_sweep(args.ranks)
        records += rows
        notes += [note] if note else []
    settings = {
        "tensors": list(args.tensors),
        "big_gb": list(args.big_gb),
        "ranks": list(args.ranks),
        "repeats": args.repeats,
        "quick": args.quick,
        "seconds": time.perf_counter() - started,
    }
    if args.results and args.sweeps != set(SWEEPS):
        records, notes, settings = keep_other_sweeps(args.out / "scale.json", args.sweeps,
                                                     records, notes, settings)  # fmt: skip
    text = write_outputs(args.out, machine, settings, records, notes)
    print(text)
    if args.results:
        update_docs(DOCS_PAGE, text, figure=(args.out / "scale.png").is_file())
        print(f"wrote {args.out}/scale.* and the results section of {DOCS_PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
