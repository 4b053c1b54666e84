"""A torchrun job for the sharded tests: FSDP2 (``fully_shard``) + AdamW on CPU/gloo, saved with a
distributed :class:`CheckpointStore` (every rank writes its own shards' deltas).

    torchrun --nproc-per-node 2 tests/jobs/sharded_job.py train --dir STORE --out OUT [--fault ...]
    torchrun --nproc-per-node 4 tests/jobs/sharded_job.py load --dir STORE --out OUT --ref REF.pt

``train`` resumes from the newest committed checkpoint (if any), trains to ``--steps`` saving
every ``--every`` steps, and writes (rank 0) the full final state to ``OUT/final.pt`` (gathered
for the comparison only) and what each attempt found at its start to ``OUT/attempt<N>.json``.
Faults, each ``KIND:ATTEMPT:STEP:RANK`` (attempt = torchrun's restart count):

- ``before-commit``: the rank exits (``os._exit``) once its part of checkpoint STEP is durable,
  before reporting it to the coordinator;
- ``kill``: the rank SIGKILLs itself after the optimizer step STEP (mid-training), once the
  checkpoints it saved before have committed (so the resume point does not depend on timing).

``load`` builds the model on this job's world size (uneven shards), loads the newest checkpoint
into its sharded state dicts and compares every value with ``--ref``, writing OUT/load<rank>.json.

With ``--fsdp1 STORE``, each mode also runs the same model under FSDP1 (``FullyShardedDataParallel``
on CPU), whose sharded state dicts hold ``ShardedTensor`` leaves: ``train`` trains it a few steps
saving each one and loads the newest checkpoint into a fresh FSDP1 model (same layout); ``load``
loads it into FSDP1 on this world size. Both write each rank's local shards for the test to
compare with a one-process load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

SHARDED = StateDictOptions(full_state_dict=False)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(torch.nn.Module):
    """Uneven on purpose: 7 and 5 rows split badly over 2, 3 and 4 ranks; ``tiny`` has one
    element (empty local shards); ``scale`` is a plain buffer (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(5, 12)
        self.down = torch.nn.Linear(12, 7)
        self.tiny = torch.nn.Parameter(torch.randn(1))
        self.odd = torch.nn.Parameter(torch.randn(5, 3))
        self.register_buffer("scale", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * self.tiny + (x @ self.odd * self.scale).sum()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=SHARDED),
        "optim": get_optimizer_state_dict(model, opt, options=SHARDED),
    }


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, opt, options=FULL),
    }


def restore(store: CheckpointStore, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint into the live sharded state; returns its step."""
    state = store.load(into=sharded_state(model, opt))
    set_model_state_dict(model, state["model"], options=SHARDED)
    set_optimizer_state_dict(model, opt, state["optim"], options=SHARDED)
    assert store.loaded_step is not None
    return store.loaded_step


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    model(torch.randn(4, 5, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def parse_faults(specs: list[str]) -> list[tuple[str, int, int, int]]:
    out = []
    for spec in specs:
        kind, attempt, step, rank = spec.split(":")
        out.append((kind, int(attempt), int(step), int(rank)))
    return out


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = [f for f in parse_faults(args.fault) if f[1] == attempt and f[3] == rank]
    model, opt = build()
    store = CheckpointStore(args.dir, distributed=True, collective_timeout_s=60, chunk_size=64)
    before = store.steps()
    start = restore(store, model, opt) if before else 0
    if rank == 0:
        store.claim_generation(attempt)
        record = {"attempt": attempt, "steps": before, "resumed_from": start}
        (Path(args.out) / f"attempt{attempt}.json").write_text(json.dumps(record))
    for kind, _, step, _ in faults:
        if kind == "before-commit":
            gather = store._group.gather

            def exit_before_report(value: Any, gather: Any = gather, step: int = step) -> Any:
                if value.step == step:
                    os._exit(9)  # the part is durable; the coordinator never hears of it
                return gather(value)

            store._group.gather = exit_before_report  # type: ignore[method-assign]
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, step)
        if any(kind == "kill" and s == step for kind, _, s, _ in faults):
            store.wait()  # the checkpoints saved so far commit first: a deterministic resume
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.every == 0:
            store.save(sharded_state(model, opt), step)
    store.close()
    final = full_state(model, opt)
    if rank == 0:
        torch.save(final, Path(args.out) / "final.pt")


def load(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    model, opt = build()
    store = CheckpointStore(args.dir)
    step = restore(store, model, opt)
    ref = torch.load(args.ref, weights_only=False)
    live = sharded_state(model, opt)
    checked = 0
    for group, tree in (("model", live["model"]), ("optim", live["optim"]["state"])):
        flat = (
            tree.items()
            if group == "model"
            else ((f"{fqn}/{k}", v) for fqn, s in tree.items() for k, v in s.items())
        )
        for key, value in flat:
            if group == "model":
                expect = ref["model"][key]
            else:
                fqn, name = key.rsplit("/", 1)
                expect = ref["optim"]["state"][fqn][name]
            got = value.full_tensor() if isinstance(value, DTensor) else value
            assert got.dtype == expect.dtype and got.shape == expect.shape, key
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), expect.reshape(-1).view(torch.uint8)
            ), key
            checked += 1
    assert live["optim"]["param_groups"] == ref["optim"]["param_groups"]
    local = {
        k: list(v.to_local().shape) for k, v in live["model"].items() if isinstance(v, DTensor)
    }
    store.close()
    (Path(args.out) / f"load{rank}.json").write_text(
        json.dumps({"rank": rank, "step": step, "checked": checked, "local_shapes": local})
    )


def build_fsdp1() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def local_shards(tree: Any) -> Any:
    """A state with each ``ShardedTensor`` as its local shards: ``[(offsets, tensor), ...]``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_shards(v) for v in tree]
    if isinstance(tree, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in tree.local_shards()]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def fsdp1_train(args: argparse.Namespace) -> None:
    """FSDP1 (``ShardedTensor`` state dicts): train and save 3 steps (a full checkpoint, then
    deltas), reload into a fresh model of the same layout; each rank writes its live shards to
    ``OUT/fsdp1_rank<rank>.pt``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    model, opt = build_fsdp1()
    with CheckpointStore(args.fsdp1, distributed=True, chunk_size=64) as store:
        for step in range(1, 4):
            train_step(model, opt, step)
            state = sharded_state(model, opt)
            assert isinstance(state["model"]["up.weight"], ShardedTensor)
            store.save(state, step)
    expect = local_shards(sharded_state(model, opt))
    fresh, fresh_opt = build_fsdp1()
    with CheckpointStore(args.fsdp1) as store:
        assert restore(store, fresh, fresh_opt) == 3
    same(local_shards(sharded_state(fresh, fresh_opt)), expect)
    torch.save(expect, Path(args.out) / f"fsdp1_rank{dist.get_rank()}.pt")


def fsdp1_load(args: argparse.Namespace) -> None:
    """Load the FSDP1 checkpoint on this world size; each rank writes its shards to
    ``OUT/fsdp1_load<rank>.pt``."""
    model, opt = build_fsdp1()
    with CheckpointStore(args.fsdp1) as store:
        assert restore(store, model, opt) == 3
    shards = local_shards(sharded_state(model, opt))
    torch.save(shards, Path(args.out) / f"fsdp1_load{dist.get_rank()}.pt")


def same(a: Any, b: Any, path: str = "") -> None:
    """Bit-identical nested states."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    else:
        assert a == b, (path, a, b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "load"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--ref")
    parser.add_argument("--fsdp1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        (train if args.mode == "train" else load)(args)
        if args.fsdp1:
            (fsdp1_train if args.mode == "train" else fsdp1_load)(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done (every store closed): end without the interpreter's teardown, where gloo now and then
    # aborts a process ("terminate called without an active exception", exit code -6) after
    # the work is complete, which the launcher would count as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
