"""Sharded checkpoints: ours against DCP ``save`` and ``async_save`` on the same FSDP2 state.

    python -m benchmarks.sharded [--mb 200] [--checkpoints 4] [--out benchmarks/results]

Launches ``torchrun`` twice (gloo, CPU): 2 ranks train an MLP under FSDP2 + AdamW (about
``--mb`` MB of parameters and optimizer state in total) and, after each training step, every
system saves the same sharded state dict into its own directory (a rotating order), waited on
until durable before the next one starts; then each restores its newest checkpoint into a
fresh model of the same layout. A 1-rank launch then restores both checkpoints resharded 2 → 1.
Per system and checkpoint: the caller's stall, the time until durable, and the bytes each rank
wrote. Results: ``OUT/sharded.json`` and ``OUT/sharded.md``.
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

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
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
                start = time.perf_counter()
                if system == "ours":
                    handle = store.save(sd, ckpt)
                    stall = time.perf_counter() - start
                    result = handle.wait()
                    written = result.bytes_written
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
                    }
                )
        store.close()
        last = args.checkpoints
        for system in ("ours", "dcp_save"):
            fresh, fresh_opt = build(1)
            dist.barrier()
            start = time.perf_counter()
            restored = _restore(system, fresh, fresh_opt, state, work, last, sharded)
            set_model_state_dict(fresh, restored["model"], options=sharded)
            set_optimizer_state_dict(fresh, fresh_opt, restored["optim"], options=sharded)
            records.append(
                {"system": system, "rank": rank, "restore_s": time.perf_counter() - start}
            )
    else:  # resharded: the 2-rank checkpoints into this world size
        for system in ("ours", "dcp_save"):
            fresh, fresh_opt = build(1)
            start = time.perf_counter()
            restored = _restore(system, fresh, fresh_opt, state, work, args.checkpoints, sharded)
            set_model_state_dict(fresh, restored["model"], options=sharded)
            set_optimizer_state_dict(fresh, fresh_opt, restored["optim"], options=sharded)
            records.append(
                {"system": system, "rank": rank, "reshard_restore_s": time.perf_counter() - start}
            )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        out = [r for part in gathered for r in part]
        (work / f"{args.mode}.json").write_text(json.dumps({"layers": layers, "records": out}))
    dist.barrier()
    dist.destroy_process_group()


def _restore(
    system: str, model: Any, opt: Any, state: Any, work: Path, step: int, options: Any
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from lightning_incremental.core import CheckpointStore

    target = state(model, opt)
    if system == "ours":
        return CheckpointStore(work / "ours").load(step, into=target)
    dcp.load(target, checkpoint_id=str(work / "dcp_save" / f"step{step}"))
    return target


def _launch(nproc: int, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "-m", "benchmarks.sharded", "--worker", mode, "--work", str(work),
        "--mb", str(args.mb), "--checkpoints", str(args.checkpoints),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, timeout=900)
    return json.loads((work / f"{mode}.json").read_text())


def _summary(save: dict[str, Any], reshard: dict[str, Any], args: argparse.Namespace) -> str:
    rows = save["records"]
    systems = ["ours", "dcp_save", "dcp_async_save"]
    lines = [
        "# Sharded checkpoints: ours vs DCP save / async_save",
        "",
        f"`python -m benchmarks.sharded --mb {args.mb} --checkpoints {args.checkpoints}`: 2 gloo "
        f"ranks on CPU, FSDP2 + AdamW, {save['layers']} Linear(2048, 2048) layers. A checkpoint "
        "follows each training step (every parameter and moment changes: dense updates). "
        "Per checkpoint after the first, mean over checkpoints and ranks.",
        "",
        "| system | stall s | durable s | MB written per rank | x state per rank |",
        "|---|---|---|---|---|",
    ]
    figures: dict[str, dict[str, float]] = {}
    for system in systems:
        mine = [r for r in rows if r.get("system") == system and r.get("checkpoint", 0) > 1]
        first = [r for r in rows if r.get("system") == system and r.get("checkpoint") == 1]
        if not mine:
            continue

        def mean(key: str, items: list[dict[str, Any]] = mine) -> float:
            return sum(r[key] for r in items) / len(items)

        figures[system] = {
            "stall_s": mean("stall_s"),
            "durable_s": mean("durable_s"),
            "mb_per_rank": mean("bytes_written") / 1e6,
            "first_mb_per_rank": mean("bytes_written", first) / 1e6,
            "ratio": mean("bytes_written") / mean("bytes_local"),
        }
        f = figures[system]
        lines.append(
            f"| {system} | {f['stall_s']:.3f} | {f['durable_s']:.3f} | {f['mb_per_rank']:.1f} "
            f"| {f['ratio']:.2f} |"
        )
    restore = {
        system: max(r["restore_s"] for r in rows if r.get("system") == system and "restore_s" in r)
        for system in ("ours", "dcp_save")
    }
    reshard_s = {
        system: max(r["reshard_restore_s"] for r in reshard["records"] if r["system"] == system)
        for system in ("ours", "dcp_save")
    }
    lines += [
        "",
        "| restore (slowest rank) | ours s | DCP load s | ours / DCP |",
        "|---|---|---|---|",
        f"| same layout, 2 ranks | {restore['ours']:.3f} | {restore['dcp_save']:.3f} | "
        f"{restore['ours'] / restore['dcp_save']:.2f} |",
        f"| resharded 2 → 1 rank | {reshard_s['ours']:.3f} | {reshard_s['dcp_save']:.3f} | "
        f"{reshard_s['ours'] / reshard_s['dcp_save']:.2f} |",
        "",
    ]
    ours, ref = figures["ours"], figures["dcp_save"]
    asy = figures["dcp_async_save"]
    lines += [
        "Ratios (ours / DCP): stall vs async_save "
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
    parser.add_argument("--checkpoints", type=int, default=4)
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
