"""Cost against size: ``python -m benchmarks.suites.scale [--quick] [--results]``.

Three sweeps, each figure of ours a ratio to its baseline measured in the same run:

* **Many tensors** (``--tensors``, default 2,000 and 20,000 tensors of 4 KiB, float32, in
  ``{"model": {"layers.{i // 8}.w{i % 8}": t}}``). Three saves into one store: the first (a full
  base), the second of the unchanged state, the third with 1 % of the tensors changed. Figures:
  the stall of each ``save`` call against the whole of ``torch.save`` + fsync; the time to
  durable (``save`` to ``result()``) against ``torch.save`` + fsync; the restore in a fresh
  process (``CheckpointStore(url).load()``; only the load is timed, not the imports) against
  ``torch.load`` in a fresh process; the bytes of the unchanged save's manifest per tensor.
* **Big state** (``--big-gb``, default 1 GB in 8 float32 tensors). Five saves, every tensor
  changed in place (``add_(1)``: a dense update) before each after the first. Figures: the
  stall of the third save (steady state: snapshot buffers recycled) against copying the state
  into buffers that already exist (``dst.copy_(src)``, the memory-bandwidth bound, timed right
  before that save); the time
  to durable of the steady saves (the third on) against ``torch.save`` + fsync after each;
  restores in a fresh process of the full base (the first save) and of the end of the chain
  of five against ``torch.load`` (with what the chain's end is made of, see
  :func:`chain_makeup`); the peak extra host memory of the first save (snapshot
  buffers allocated) and of the fourth (recycled), as a multiple of the state
  (``benchmarks.harness.memory``: ``VmHWM``), beside ``torch.save``'s.
* **Many ranks, simulated**: the records of ``benchmarks.suites.scale_ranks.run(ranks=...)`` (commit
  time against ranks), skipped with a note where that module is absent.

Times are the best of ``--repeats``; every store is on the same local disk as the baseline's
files (``--dir``), with fsync on. ``torch.save`` + fsync runs after each of our saves (the same
disk state for both), each into a new file kept until the sweep's attempt ends, as our saves
write new objects (see :func:`new_file_save`). Writes ``scale.{json,md,png}`` under ``--out``
(default ``bench_out/scale/``); ``--results`` writes them to ``benchmarks/results/`` and
regenerates the results section of ``docs/guides/scale.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.machine import describe, parallel_scaling
from benchmarks.harness.memory import peak_extra_rss
from benchmarks.harness.state import tensor_bytes
from benchmarks.harness.timing import torch_save

RESULTS = Path(__file__).parent.parent / "results"
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "scale.md"
TENSOR_NUMEL = 1024  # 4 KiB of float32
BIG_TENSORS = 8
CHAIN = 5
CHANGED_FRACTION = 0.01

# Targets: ratios to the baseline, except where ``absolute`` (a value in the figure's unit).
STALL_TARGET = 0.1
DURABLE_TARGET = 1.0
RESTORE_TARGET = 1.2
MANIFEST_TARGET_B = 64.0
COPY_STALL_TARGET = 1.5  # the steady big-state stall, to a copy into existing buffers
PEAK_MEMORY_TARGET_X = 2.1  # peak extra host memory of a save, a multiple of the state


def record(
    sweep: str,
    case: str,
    size: float,
    figure: str,
    ours: float,
    baseline: float | None,
    baseline_name: str | None,
    unit: str,
    target: float | None = None,
    absolute: bool = False,
    detail: str | None = None,
) -> dict[str, Any]:
    """One row: ``ratio`` is ours / baseline; ``met`` compares the ratio (or, ``absolute``, our
    value) with ``target`` (None: no target); ``detail``: what the figure depends on, printed
    as a note under the table."""
    # a multiple of the state beside a baseline near zero is no ratio
    ratio = ours / baseline if baseline and unit != "x" else None
    checked = ours if absolute else ratio
    met = None if target is None or checked is None else bool(checked <= target)
    return {
        "sweep": sweep,
        "case": case,
        "size": size,
        "figure": figure,
        "ours": ours,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "target_absolute": absolute,
        "met": met,
        "detail": detail,
    }


# ----------------------------------------------------------------------------- restores


def child(kind: str, path: str, step: int | None) -> None:
    """One restore, timed in this fresh process (imports done first); prints one JSON line."""
    from lightning_incremental.core import CheckpointStore

    gc.collect()
    started = time.perf_counter()
    if kind == "torch":
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = CheckpointStore(path).load(step)
    seconds = time.perf_counter() - started
    assert tensor_bytes(loaded) > 0
    print(json.dumps({"seconds": seconds}))


def fresh_restore(kind: str, path: Path, repeats: int, step: int | None = None) -> float:
    """Best seconds of ``repeats`` restores, each in a new process."""
    command = [sys.executable, "-m", "benchmarks.suites.scale", "--child", kind]
    command += ["--path", str(path)]
    command += ["--step", str(step)] if step is not None else []
    best = math.inf
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{kind} restore of {path} failed:\n{done.stderr[-3000:]}")
        best = min(best, json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    return best


def timed_save(
    store: Any, state: dict[str, Any], step: int, efforts: list[tuple[str, float]] | None = None
) -> tuple[float, float]:
    """(stall, time to durable) of one save: the ``save`` call, and ``save`` to ``result()``;
    the effort it used (``SaveResult.effort``) and the share of its changed chunks it stored as
    they are are appended to ``efforts``."""
    started = time.perf_counter()
    handle = store.save(state, step=step)
    stall = time.perf_counter() - started
    result = handle.result()
    durable = time.perf_counter() - started
    if efforts is not None:
        changed = result.chunks_full + result.chunks_delta
        efforts.append((result.effort, result.chunks_as_is / changed if changed else 0.0))
    return stall, durable


def efforts_detail(efforts: list[tuple[str, float]], fastest: tuple[str, float]) -> str:
    """What ``codec_effort="auto"`` chose for the timed saves (``timed_save``'s ``efforts``):
    the time to durable of a dense save depends on it (a save coded in full runs at the codec's
    speed, one stored as it is at the disk's; a paced one codes what the disk's time allows)."""
    count = {e: sum(1 for effort, _ in efforts if effort == e) for e in ("fast", "full", "paced")}
    shares = [share for effort, share in efforts if effort == "paced"]
    paced = f"{count['paced']} were paced"
    if shares:
        paced += f" (stored {100 * min(shares):.0f}-{100 * max(shares):.0f} % of them as they are)"
    said = {"fast": "stored them as they are", "full": "coded them", "paced": "was paced"}
    return (
        f'the steady saves timed for durability under codec_effort="auto": {count["fast"]} of '
        f"{len(efforts)} stored their changed chunks as they are, {count['full']} coded them in "
        f"full, {paced}; the fastest {said.get(fastest[0], fastest[0])}"
    )


def new_file_save(state: Any, directory: Path) -> float:
    """Seconds of ``torch.save`` + fsync into a new file in ``directory``, kept there (the
    caller removes the directory).

    A new file, as each of our saves writes new objects: on a disk that allocates blocks
    lazily (a thin-provisioned virtual disk, as cloud machines have), writing over a file's
    blocks again costs a fraction of writing new ones (1 GB rewritten in place: 0.67 s; into a
    new file once a few were kept: 2.9 s, on the machine of the results below). A baseline
    that rewrites one file would measure the disk's reuse of warm blocks, not ``torch.save``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    return torch_save(state, directory / f"{len(list(directory.iterdir()))}.pt")


# ----------------------------------------------------------------------------- many tensors


def many_tensors_state(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(TENSOR_NUMEL) for i in range(n)}}


def newest_manifest_bytes(store_dir: Path) -> int:
    newest = max((store_dir / "manifests").glob("*.json"), key=lambda p: p.name)
    return newest.stat().st_size


def tensors_sweep(n: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """The many-tensors figures for ``n`` tensors of 4 KiB."""
    from lightning_incremental.core import CheckpointStore

    state = many_tensors_state(n)
    values = list(state["model"].values())
    changed = values[:: max(1, round(1 / CHANGED_FRACTION))]
    saves: dict[str, list[tuple[float, float]]] = {"full": [], "unchanged": [], "1% changed": []}
    manifest = math.inf
    store_dir = root / f"tensors-{n}"
    plain = root / f"tensors-{n}.pt"
    kept = root / f"tensors-{n}-baseline"
    baselines = []
    for _ in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        with CheckpointStore(store_dir) as store:
            saves["full"].append(timed_save(store, state, 1))
            baselines.append(new_file_save(state, kept))  # interleaved: the same disk state
            saves["unchanged"].append(timed_save(store, state, 2))
            manifest = min(manifest, newest_manifest_bytes(store_dir))
            for t in changed:
                t.add_(1)
            saves["1% changed"].append(timed_save(store, state, 3))
            baselines.append(new_file_save(state, kept))
    baseline = min(baselines)
    shutil.rmtree(kept, ignore_errors=True)
    torch_save(state, plain)
    ours_load = fresh_restore("ours", store_dir, repeats)
    torch_load = fresh_restore("torch", plain, repeats)
    case = f"{n:,} tensors"
    rows = []
    for kind, runs in saves.items():
        stall, durable = min(s for s, _ in runs), min(d for _, d in runs)
        rows.append(
            record(
                "tensors",
                case,
                n,
                f"stall, {kind} save",
                stall,
                baseline,
                "torch.save + fsync",
                "s",
                STALL_TARGET,
            )
        )
        rows.append(
            record(
                "tensors",
                case,
                n,
                f"time to durable, {kind} save",
                durable,
                baseline,
                "torch.save + fsync",
                "s",
                DURABLE_TARGET,
            )
        )
    rows.append(
        record(
            "tensors",
            case,
            n,
            "restore, fresh process",
            ours_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
        )
    )
    rows.append(
        record(
            "tensors",
            case,
            n,
            "manifest of an unchanged save, per tensor",
            manifest / n,
            None,
            None,
            "B",
            MANIFEST_TARGET_B,
            absolute=True,
        )
    )
    shutil.rmtree(store_dir, ignore_errors=True)
    plain.unlink(missing_ok=True)
    return rows


# ----------------------------------------------------------------------------- big state


def big_state(nbytes: int) -> dict[str, Any]:
    numel = max(1, nbytes // 4 // BIG_TENSORS)
    return reset_big_state({"model": {f"w{i}": torch.empty(numel) for i in range(BIG_TENSORS)}})


def reset_big_state(state: dict[str, Any]) -> dict[str, Any]:
    """The big state's first values again, in place (``randn`` after seed 0): every attempt
    saves the same five states. Carried over from the attempt before, ``add_(1)`` would move
    values already far from zero by a nearly constant integer step, whose deltas code to
    almost nothing (a 4 MiB chunk's ``sub`` delta: 0.47x raw at the fourth save, 0.04x at the
    14th), and the later attempts would measure another workload."""
    torch.manual_seed(0)
    for t in state["model"].values():
        t.normal_()
    return state


class CopyBound:
    """Copies of every tensor into buffers allocated (and touched) beforehand: the
    memory-bandwidth bound of a snapshot. Timed right before each steady save, not once
    before the sweep: on this host the same copy took 28 ms in one run and 44 ms in another
    (and 29-51 ms within one process), so only copies timed beside the saves compare."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.src = list(state["model"].values())
        self.dst = [torch.empty_like(t) for t in self.src]
        self.best = math.inf
        self.measure(1)  # faulted in: the bound is the copy, not the page faults
        self.best = math.inf  # ... nor this first copy

    def measure(self, repeats: int) -> None:
        """Time ``repeats`` copies; ``best`` keeps the fastest so far."""
        for _ in range(repeats):
            started = time.perf_counter()
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s)
            self.best = min(self.best, time.perf_counter() - started)


def chain_makeup(store_dir: Path, step: int) -> str:
    """What a restore of ``step`` decodes: its chunks by how each is stored (a delta: at which
    depth, its links to decode on top of its root), and the bytes it reads against the raw bytes.

    It varies from run to run, and the restore's time with it: under ``codec_effort="auto"``
    (the default) a save whose background thread waited for a CPU longer than it ran stores its
    changed chunks as they are (codec ``s``), and the next save's deltas then have such roots;
    a chunk stored as it is restores at copy speed, a coded one at the codec's, a delta at
    about the sum of its root's and its own."""
    from lightning_incremental.core import CheckpointStore

    with CheckpointStore(str(store_dir)) as store:
        doc = store.manifest(step).to_dict()
    chunks = doc["chunks"]
    kinds: Counter[str] = Counter()
    read = raw = 0
    for tensor in doc["tensors"]:
        for digest in tensor["chunks"]:
            recipe = root = chunks[digest]
            while root.get("base"):
                root = chunks[root["base"]]
            plain = root["kind"] == "s"
            if recipe["depth"]:
                on = "a root stored as it is" if plain else "a coded root"
                kinds[f"deltas at depth {recipe['depth']} on {on}"] += 1
            else:
                kinds["stored as they are" if plain else "coded standalone"] += 1
            read += recipe["chain"] or recipe["length"]
            raw += recipe["size"]
    parts = ", ".join(f"{n} {what}" for what, n in sorted(kinds.items()))
    count = sum(kinds.values())
    return f"restored {count} chunks ({parts}), reading {read / raw:.2f}x their raw bytes"


def big_sweep(nbytes: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """The big-state figures for a state of about ``nbytes`` in 8 tensors."""
    from lightning_incremental.core import CheckpointStore

    state = big_state(nbytes)
    size = tensor_bytes(state)
    gb = size / 1e9
    case = f"{gb:.3g} GB in {BIG_TENSORS} tensors"
    copy = CopyBound(state)
    plain = root / "big.pt"
    with peak_extra_rss() as plain_peak:
        torch_save(state, plain)
    store_dir, kept = root / "big-store", root / "big-baseline"
    stalls, durables, peaks, baselines = [], [], {}, []
    efforts: list[tuple[str, float]] = []
    for attempt in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        reset_big_state(state)
        with CheckpointStore(store_dir) as store:
            for step in range(1, CHAIN + 1):
                if step > 1:
                    for t in state["model"].values():
                        t.add_(1)
                if step in (1, 4) and attempt == 0:
                    with peak_extra_rss() as peak:
                        timed_save(store, state, step)
                    peaks[step] = peak.extra_bytes
                    steady = False
                else:
                    if step == 3:
                        copy.measure(3)  # the bound, timed beside the save it bounds
                    steady = step >= 3  # snapshot buffers recycled
                    stall, durable = timed_save(store, state, step, efforts if steady else None)
                    if step == 3:
                        stalls.append(stall)
                    if steady:
                        durables.append(durable)
                # Each of our saves followed by torch.save of the same state into a new file:
                # the same disk state for both, the same bytes kept on it; the time to durable
                # compares the steady saves (the third on) with the torch.save after each.
                plain_s = new_file_save(state, kept)
                if steady:
                    baselines.append(plain_s)
    shutil.rmtree(kept, ignore_errors=True)
    copy.dst.clear()  # the restores below run with the memory they had before
    baseline = min(baselines)
    torch_load = fresh_restore("torch", plain, repeats)
    base_load = fresh_restore("ours", store_dir, repeats, step=1)
    chain_load = fresh_restore("ours", store_dir, repeats, step=CHAIN)
    makeup = chain_makeup(store_dir, CHAIN)
    rows = [
        record(
            "big",
            case,
            gb,
            "stall, steady save",
            min(stalls),
            copy.best,
            "copy into existing buffers",
            "s",
            COPY_STALL_TARGET,
        ),
        record(
            "big",
            case,
            gb,
            "time to durable, steady save",
            min(durables),
            baseline,
            "torch.save + fsync",
            "s",
            DURABLE_TARGET,
            detail=efforts_detail(efforts, efforts[durables.index(min(durables))]),
        ),
        record(
            "big",
            case,
            gb,
            "restore of the full base, fresh process",
            base_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
        ),
        record(
            "big",
            case,
            gb,
            f"restore of a chain of {CHAIN} saves, fresh process",
            chain_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
            detail=f"step {CHAIN} of the chain {makeup}",
        ),
    ]
    plain_x = None if plain_peak.extra_bytes is None else plain_peak.extra_bytes / size
    for step, label in ((1, "first save"), (4, "steady save")):
        if peaks.get(step) is not None:
            rows.append(
                record(
                    "big",
                    case,
                    gb,
                    f"peak extra host memory, {label} (x state)",
                    peaks[step] / size,
                    plain_x,
                    "torch.save + fsync",
                    "x",
                    PEAK_MEMORY_TARGET_X,
                    absolute=True,
                )
            )
    shutil.rmtree(store_dir, ignore_errors=True)
    plain.unlink(missing_ok=True)
    return rows


# ----------------------------------------------------------------------------- many ranks


def ranks_sweep(ranks: tuple[int, ...]) -> tuple[list[dict[str, Any]], str | None]:
    """The simulated many-ranks records, or a note why there are none."""
    try:
        module = importlib.import_module("benchmarks.suites.scale_ranks")
    except ModuleNotFoundError as error:
        if error.name != "benchmarks.suites.scale_ranks":
            raise
        return [], "many ranks: skipped, benchmarks/suites/scale_ranks.py is not in this checkout"
    rows = [dict(r) for r in module.run(ranks=ranks)]
    for r in rows:
        r.setdefault("sweep", "ranks")
    return rows, None


# ----------------------------------------------------------------------------- command


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v.replace("_", "")) for v in text.split(",") if v.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suites.scale",
        description=__doc__,
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
