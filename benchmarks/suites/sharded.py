"""Sharded checkpoints: ours against DCP ``save`` and ``async_save`` on the same FSDP2 state.

    python -m benchmarks.suites.sharded [--mb 200] [--checkpoints 7] [--restores 5] [--out DIR]

Launches ``torchrun`` twice (gloo, CPU): 2 ranks train an MLP under FSDP2 + AdamW (about
``--mb`` MB of parameters and optimizer state in total) and, after each training step, every
system saves the same sharded state dict into its own directory (a rotating order), waited on
until durable before the next one starts; then each restores its newest checkpoint into a
fresh model of the same layout (``--restores`` times, alternating). A 1-rank launch then restores
both checkpoints resharded 2 → 1. Per system and checkpoint: the caller's stall, the time until
durable, the bytes each rank wrote and its peak extra host memory
(``benchmarks.harness.memory.peak_extra_rss``); per restore its time and peak extra memory. Results:
``OUT/sharded.json`` and ``OUT/sharded.md``.
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

from benchmarks.harness.memory import peak_extra_rss

ROOT = Path(__file__).resolve().parents[2]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_incremental.core import CheckpointStore

    sharded = StateDictOptions(full_state_dict=False)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    work = Path(args.work)
    width = 2048
    layers = max(1, round(args.mb * 1e6 / 12 / (width * width)))  # params + 2 AdamW moments

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def state(model: Any, opt: Any) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(model, options=sharded),
            "optim": get_optimizer_state_dict(model, opt, options=sharded),
        }

    def local_bytes(tree: Any) -> int:
        if isinstance(tree, dict):
            return sum(local_bytes(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(local_bytes(v) for v in tree)
        if isinstance(tree, DTensor):
            return tree.to_local().nbytes
        return tree.nbytes if isinstance(tree, torch.Tensor) else 0

    def step(model: Any, opt: Any, i: int) -> None:
        g = torch.Generator().manual_seed(i * 100 + rank)
        model(torch.randn(8, width, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def files_of(path: Path) -> int:
        names = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        return sum((path / n).stat().st_size for n in names if (path / n).exists())

    records: list[dict[str, Any]] = []
    if args.mode == "save":
        model, opt = build(0)
        step(model, opt, 0)
        store = CheckpointStore(work / "ours", distributed=True)
        pending: Any = None
        systems = ["ours", "dcp_save", "dcp_async_save"]
        for ckpt in range(1, args.checkpoints + 1):
            step(model, opt, ckpt)
            sd = state(model, opt)
            order = systems[ckpt % 3 :] + systems[: ckpt % 3]
            for system in order:
                dist.barrier()
                target = work / system / f"step{ckpt}"
                held = 0
                with peak_extra_rss() as peak:
                    start = time.perf_counter()
                    if system == "ours":
                        handle = store.save(sd, ckpt)
                        stall = time.perf_counter() - start
                        result = handle.wait()
                        written = result.bytes_written
                        held = _held(store)
                    elif system == "dcp_save":
                        dcp.save(sd, checkpoint_id=str(target))
                        stall = time.perf_counter() - start
                    else:
                        pending = dcp.async_save(sd, checkpoint_id=str(target))
                        stall = time.perf_counter() - start
                        pending.result()
                    durable = time.perf_counter() - start
                if system != "ours":
                    written = files_of(target)
                records.append(
                    {
                        "system": system,
                        "checkpoint": ckpt,
                        "rank": rank,
                        "stall_s": stall,
                        "durable_s": durable,
                        "bytes_written": written,
                        "bytes_local": local_bytes(sd),
                        "peak_extra": peak.extra_bytes,
                        "held": held,
                    }
                )
        store.close()
        last = args.checkpoints
        for repeat in range(args.restores):
            for system in ("ours", "dcp_save"):
                fresh, fresh_opt = build(1)
                dist.barrier()
                records.append(
                    {"system": system, "rank": rank, "repeat": repeat}
                    | _timed_restore(system, fresh, fresh_opt, state, work, last, sharded, "")
                )
    else:  # resharded: the 2-rank checkpoints into this world size
        for repeat in range(args.restores):
            for system in ("ours", "dcp_save"):
                fresh, fresh_opt = build(1)
                records.append(
                    {"system": system, "rank": rank, "repeat": repeat}
                    | _timed_restore(
                        system, fresh, fresh_opt, state, work, args.checkpoints, sharded, "reshard_"
                    )
                )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        out = [r for part in gathered for r in part]
        (work / f"{args.mode}.json").write_text(json.dumps({"layers": layers, "records": out}))
    dist.barrier()
    dist.destroy_process_group()


def _timed_restore(
    system: str,
    model: Any,
    opt: Any,
    state: Any,
    work: Path,
    step: int,
    options: Any,
    prefix: str,
) -> dict[str, Any]:
    """Restore into a fresh model as a resuming job does: build its sharded state dicts (the
    optimizer's state initialised), load into them, set them. ``restore_s``: all of it;
    ``load_s``: the load alone (``load_cpu_s``: its CPU time, every thread of the process: the
    work itself, whatever else the machine runs); ``restore_peak_extra``: peak extra host
    memory of load + set."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    start = time.perf_counter()
    target = state(model, opt)
    with peak_extra_rss() as peak:
        loading, cpu = time.perf_counter(), time.process_time()
        restored = _restore(system, target, work, step)
        loaded, cpu = time.perf_counter(), time.process_time() - cpu
        set_model_state_dict(model, restored["model"], options=options)
        set_optimizer_state_dict(model, opt, restored["optim"], options=options)
    done = time.perf_counter()
    return {
        f"{prefix}restore_s": done - start,
        f"{prefix}load_s": loaded - loading,
        f"{prefix}load_cpu_s": cpu,
        f"{prefix}restore_peak_extra": peak.extra_bytes,
    }


def _restore(system: str, target: dict[str, Any], work: Path, step: int) -> dict[str, Any]:
    """Load checkpoint ``step`` of ``system`` into the live sharded state ``target``."""
    import torch.distributed.checkpoint as dcp

    from lightning_incremental.core import CheckpointStore

    if system == "ours":
        with CheckpointStore(work / "ours") as store:
            return store.load(step, into=target)
    dcp.load(target, checkpoint_id=str(work / "dcp_save" / f"step{step}"))
    return target


def _held(store: Any) -> int:
    """Host bytes the store keeps between saves: the XOR base (the last snapshot) and the
    recycled snapshot buffers."""
    base = store._engine.base
    parent = base.parent
    kept = sum(t.numel() * t.element_size() for t in parent.buffers.values()) if parent else 0
    return int(kept + base.pool.nbytes)


def _launch(nproc: int, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "-m", "benchmarks.suites.sharded", "--worker", mode, "--work", str(work),
        "--mb", str(args.mb), "--checkpoints", str(args.checkpoints),
        "--restores", str(args.restores),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, timeout=900)
    return json.loads((work / f"{mode}.json").read_text())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _summary(save: dict[str, Any], reshard: dict[str, Any], args: argparse.Namespace) -> str:
    rows = save["records"]
    systems = ["ours", "dcp_save", "dcp_async_save"]
    mb = 1e6
    lines = [
        "# Sharded checkpoints: ours vs DCP save / async_save",
        "",
        f"`python -m benchmarks.suites.sharded --mb {args.mb} --checkpoints {args.checkpoints} "
        f"--restores {args.restores}`: 2 gloo "
        f"ranks on CPU, FSDP2 + AdamW, {save['layers']} Linear(2048, 2048) layers. A checkpoint "
        "follows each training step (every parameter and moment changes: dense updates). "
        "Per checkpoint after the first, over checkpoints and ranks: median (mean in brackets). "
        "Memory: peak extra resident memory of the rank while the save runs until durable "
        "(VmHWM reset at the save's start, minus VmRSS then), and what the store keeps between "
        "saves (the XOR base and the recycled snapshot buffers), per rank.",
        "",
        "| system | stall s | durable s | MB written per rank | x state per rank "
        "| peak extra MB (x shard) | held between saves MB |",
        "|---|---|---|---|---|---|---|",
    ]
    figures: dict[str, dict[str, float]] = {}
    for system in systems:
        mine = [r for r in rows if r.get("system") == system and r.get("checkpoint", 0) > 1]
        first = [r for r in rows if r.get("system") == system and r.get("checkpoint") == 1]
        if not mine:
            continue

        def mean(key: str, items: list[dict[str, Any]] = mine) -> float:
            return sum(r[key] for r in items) / len(items)

        def med(key: str, items: list[dict[str, Any]] = mine) -> float:
            return _median([r[key] for r in items])

        figures[system] = {
            "stall_s": med("stall_s"),
            "stall_mean": mean("stall_s"),
            "durable_s": med("durable_s"),
            "durable_mean": mean("durable_s"),
            "mb_per_rank": mean("bytes_written") / mb,
            "first_mb_per_rank": mean("bytes_written", first) / mb,
            "ratio": mean("bytes_written") / mean("bytes_local"),
            "peak_mb": max(r["peak_extra"] for r in mine) / mb,
            "peak_x": max(r["peak_extra"] / r["bytes_local"] for r in mine),
            "held_mb": max(r["held"] for r in mine) / mb,
        }
        f = figures[system]
        held = f"{f['held_mb']:.0f}" if system == "ours" else "0"
        lines.append(
            f"| {system} | {f['stall_s']:.3f} ({f['stall_mean']:.3f}) | {f['durable_s']:.3f} "
            f"({f['durable_mean']:.3f}) | {f['mb_per_rank']:.1f} | {f['ratio']:.2f} "
            f"| {f['peak_mb']:.0f} ({f['peak_x']:.2f}) | {held} |"
        )

    def restore(records: list[dict[str, Any]], prefix: str, system: str, key: str) -> float:
        """The median over repeats of the slowest (largest) rank's figure."""
        mine = [r for r in records if r["system"] == system and f"{prefix}{key}" in r]
        repeats = sorted({r["repeat"] for r in mine})
        return _median(
            [max(r[f"{prefix}{key}"] for r in mine if r["repeat"] == i) for i in repeats]
        )

    same = [r for r in rows if "restore_s" in r]
    cases = [("same layout, 2 ranks", same, ""), ("resharded 2 → 1 rank", reshard["records"],
             "reshard_")]  # fmt: skip
    lines += [
        "",
        f"Restore (slowest rank, median of {args.restores}): a fresh model's sharded state dicts "
        "built (the optimizer's state initialised), loaded into, set; *load*: the load call "
        "alone. Peak extra memory of load + set.",
        "",
        "| restore | ours s | DCP s | ours / DCP | load: ours s | DCP s | ours / DCP "
        "| load CPU: ours s | DCP s | peak extra MB: ours | DCP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, records, prefix in cases:
        o, d = (restore(records, prefix, s, "restore_s") for s in ("ours", "dcp_save"))
        lo, ld = (restore(records, prefix, s, "load_s") for s in ("ours", "dcp_save"))
        mo, md = (
            restore(records, prefix, s, "restore_peak_extra") / mb for s in ("ours", "dcp_save")
        )
        co, cd = (restore(records, prefix, s, "load_cpu_s") for s in ("ours", "dcp_save"))
        lines.append(
            f"| {name} | {o:.3f} | {d:.3f} | {o / d:.2f} | {lo:.3f} | {ld:.3f} | {lo / ld:.2f} "
            f"| {co:.3f} | {cd:.3f} | {mo:.0f} | {md:.0f} |"
        )
    ours, ref = figures["ours"], figures["dcp_save"]
    asy = figures["dcp_async_save"]
    lines += [
        "",
        "Ratios (ours / DCP, medians): stall vs async_save "
        f"{ours['stall_s'] / asy['stall_s']:.2f}, vs save {ours['stall_s'] / ref['stall_s']:.2f}; "
        f"bytes per rank vs save {ours['mb_per_rank'] / ref['mb_per_rank']:.2f}; time to durable "
        f"vs save {ours['durable_s'] / ref['durable_s']:.2f}, vs async_save "
        f"{ours['durable_s'] / asy['durable_s']:.2f}. First checkpoint (full) per rank: ours "
        f"{ours['first_mb_per_rank']:.1f} MB, DCP {ref['first_mb_per_rank']:.1f} MB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--checkpoints", type=int, default=7)
    parser.add_argument("--restores", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--worker", choices=["save", "reshard"], default=None)
    args = parser.parse_args(argv)
    if args.worker is not None:
        args.mode = args.worker
        _worker(args)
        return
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="sharded-bench-", dir=args.work))
    try:
        save = _launch(2, "save", args, work)
        reshard = _launch(1, "reshard", args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded.json").write_text(json.dumps({"save": save, "reshard": reshard}, indent=1))
    text = _summary(save, reshard, args)
    (args.out / "sharded.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
