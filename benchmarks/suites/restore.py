"""Restore: time and peak extra memory against ``torch.load`` and DCP ``load``, in one run.

``python -m benchmarks.suites.restore [--quick] [--scenario S] [--chains 1 4 8] [--json FILE]``:
trains the ``dense_fp32`` workload (a 210 MB fp32 + AdamW state; ``--quick``: 6 MB; ``--scenario
frozen90``: 90 % frozen, where delta chains reach their full depth) and saves it to this
engine's store (a full base, then deltas every ``--interval`` training steps), ``torch.save`` and
DCP ``save`` on local disk. Then every restore runs in a fresh process (its memory figures are its
own), best of ``--repeats``, with the files warm in the page cache and cold (evicted with
``posix_fadvise(DONTNEED)`` before each run):

- ``torch.load``, and ``torch.load(mmap=True)`` with every tensor read once (a second anchor);
- DCP ``load`` into the preallocated model and optimizer state (it loads in place);
- this engine's ``load()`` (new tensors) and ``load(into=state)`` (into the preallocated state),
  for the checkpoint at the end of a chain of 1, 4 and 8 checkpoints (base plus deltas).

Peak extra memory is the resident-set high-water mark above the resident set before the load
(``benchmarks.harness.memory``), as a multiple of the state's tensor bytes. Ratios are against
``torch.load`` on the same cache state; GB/s is the state's tensor bytes over the time. The
clock starts after the memory figure's set-up, which runs a full garbage collection (see
``child``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.machine import parallel_scaling
from benchmarks.harness.memory import peak_extra_rss
from benchmarks.harness.model import FULL, QUICK
from benchmarks.harness.scenarios import SCENARIOS, Params
from benchmarks.harness.state import tensor_bytes
from lightning_incremental.core.format.records import Manifest


def _workload(quick: bool, scenario: str = "dense_fp32") -> Any:
    torch.manual_seed(0)
    work = SCENARIOS[scenario].build(Params(model=QUICK if quick else FULL))
    work.train(1)  # AdamW state exists
    return work


def _state(work: Any) -> dict[str, Any]:
    return {"model": work.model.state_dict(), "optimizer": work.optimizer.state_dict()}


def prepare(
    root: Path, quick: bool, interval: int, chains: list[int], scenario: str
) -> dict[str, Any]:
    """Write the checkpoints every restore reads; returns what the children need to know."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from lightning_incremental.core import CheckpointStore

    work = _workload(quick, scenario)
    steps: dict[int, int] = {}
    with CheckpointStore(str(root / "store"), full_every=max(chains) + 1) as store:
        for index in range(1, max(chains) + 1):
            if index > 1:
                work.train(interval)
            store.save(_state(work), index).wait()
            if index in chains:
                steps[index] = index
        depth = {s: _chain_depth(store.manifest(s)) for s in steps}
    final = _state(work)
    torch.save(final, root / "state.pt")
    dcp_save(final, storage_writer=FileSystemWriter(str(root / "dcp")))
    return {"nbytes": tensor_bytes(final), "steps": steps, "depth": depth}


def _chain_depth(doc: Manifest) -> int:
    """The longest chain of deltas a chunk of this checkpoint needs on top of its base."""
    return max(doc.chunks[d].depth for t in doc.tensors for d in t.chunks)


def _evict(paths: list[Path]) -> None:
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child(args: argparse.Namespace) -> None:
    """One restore, measured in this fresh process; prints one JSON line."""
    torch.set_num_threads(1)
    root = Path(args.root)
    target: dict[str, Any] | None = None
    if args.child in ("dcp", "ours_into"):
        target = _state(_workload(args.quick, args.scenario))  # what a resuming job has
    files = {
        "torch": [root / "state.pt"],
        "torch_mmap": [root / "state.pt"],
        "dcp": [root / "dcp"],
        "ours": [root / "store"],
        "ours_into": [root / "store"],
    }[args.child]
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from lightning_incremental.core import CheckpointStore

    if args.cold:
        _evict(files)
    with peak_extra_rss() as peak:
        # The clock starts inside: the set-up of the memory figure (a full garbage collection,
        # 30-60 ms after importing torch, and malloc_trim) is not part of any restore. It also
        # pays what importing left for the cyclic collector, for every system alike; otherwise
        # that collection falls on whichever allocation next crosses its threshold, at random.
        started = time.perf_counter()
        if args.child == "torch":
            loaded = torch.load(root / "state.pt", weights_only=True)
        elif args.child == "torch_mmap":
            loaded = torch.load(root / "state.pt", weights_only=True, mmap=True)
            for value in _tensors(loaded):
                value.sum()  # read every byte once
        elif args.child == "dcp":
            assert target is not None
            dcp_load(target, storage_reader=FileSystemReader(str(root / "dcp")))
            loaded = target
        else:
            with CheckpointStore(str(root / "store")) as store:
                loaded = store.load(args.step, into=target)
        seconds = time.perf_counter() - started
    assert tensor_bytes(loaded) > 0
    print(json.dumps({"seconds": seconds, "peak": peak.extra_bytes}))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _run_child(
    root: Path, system: str, cold: bool, quick: bool, step: int | None, scenario: str
) -> dict:
    command = [sys.executable, "-m", "benchmarks.suites.restore", "--child", system]
    command += ["--root", str(root)]
    command += ["--cold"] if cold else []
    command += ["--quick"] if quick else []
    command += ["--step", str(step)] if step is not None else []
    command += ["--scenario", scenario]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{system} restore failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--scenario",
        default="dense_fp32",
        choices=sorted(SCENARIOS),
        help="the workload (frozen90: deltas stay small, so chains reach their full depth)",
    )
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="bench_out/restore")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=["torch", "torch_mmap", "dcp", "ours", "ours_into"])
    parser.add_argument("--root")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    root = Path(args.dir)
    if root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True)
    info = prepare(root, args.quick, args.interval, sorted(set(args.chains)), args.scenario)
    info["parallel_scaling"] = parallel_scaling()  # a restore decodes on two threads
    nbytes = info["nbytes"]
    rows = []
    for cold in (False, True):
        runs: list[tuple[str, int | None]] = [("torch", None), ("torch_mmap", None), ("dcp", None)]
        runs += [(s, step) for step in info["steps"] for s in ("ours", "ours_into")]
        for system, step in runs:
            best = None
            for _ in range(args.repeats):
                got = _run_child(root, system, cold, args.quick, step, args.scenario)
                if best is None or got["seconds"] < best["seconds"]:
                    best = got
            assert best is not None
            rows.append({"system": system, "chain": step, "cold": cold, **best})
    for row in rows:
        anchor = next(r for r in rows if r["system"] == "torch" and r["cold"] == row["cold"])
        row["time_vs_torch_load"] = row["seconds"] / anchor["seconds"]
        row["peak_x_state"] = None if row["peak"] is None else row["peak"] / nbytes
    print(f"state: {nbytes / 1e6:.0f} MB of tensors; chain depths {info['depth']}")
    if info["parallel_scaling"]:
        print(f"as many processes as CPUs did {info['parallel_scaling']:.2f}x one's work\n")
    print("| restore | chain | cache | seconds | GB/s | x torch.load | peak extra | x state |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak"] is None else f"{r['peak'] / 1e6:.0f} MB"
        x = "-" if r["peak_x_state"] is None else f"{r['peak_x_state']:.2f}"
        print(
            f"| {r['system']} | {r['chain'] or ''} | {'cold' if r['cold'] else 'warm'} | "
            f"{r['seconds']:.3f} | {nbytes / r['seconds'] / 1e9:.2f} | "
            f"{r['time_vs_torch_load']:.2f} | {peak} | {x} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"nbytes": nbytes, "info": info, "rows": rows}))


if __name__ == "__main__":
    main()
