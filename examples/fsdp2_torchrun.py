"""Sharded training with incremental checkpoints: torchrun + FSDP2 (``fully_shard``) + AdamW,
using :class:`CheckpointStore` directly.

    torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --dir ckpt --steps 60 --every 10
    # kill it at any point (or pass --max-restarts 3 to torchrun), run it again: it resumes
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun.py --dir ckpt --steps 80   # other size

Every rank opens the store with ``distributed=True`` and calls ``save`` with its *sharded* state
dict (``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=False``):
each rank writes only the deltas of its own shards, in the background; rank 0 commits the one
manifest once every rank's part is durable. Nothing is gathered to one rank, in either
direction: ``load(into=...)`` fills each rank's shards from the overlapping stored pieces only,
whatever the number of ranks that saved them. Runs on CPU (gloo) as well as on GPUs (NCCL).
"""

from __future__ import annotations

import argparse

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

from lightning_incremental.core import CheckpointStore

SHARDED = StateDictOptions(full_state_dict=False)


def build(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 10),
    ).to(device)  # fmt: skip
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": get_model_state_dict(model, options=SHARDED),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=SHARDED),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="fsdp2_checkpoints")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    model, optimizer = build(device)

    # Every rank, at the same time: the store creates its own gloo group for its saves.
    store = CheckpointStore(args.dir, distributed=True)
    start = 0
    if store.steps():
        # Fill this rank's shards in place from the newest checkpoint (any saving world size);
        # the optimizer's state exists already (get_optimizer_state_dict initialises it).
        state = store.load(into=state_of(model, optimizer))
        set_model_state_dict(model, state["model"], options=SHARDED)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=SHARDED)
        start = store.loaded_step or 0
    if dist.get_rank() == 0:
        store.claim_generation()  # a restarted job fences off whatever is left of the last one
        print(f"starting at step {start} on {dist.get_world_size()} ranks", flush=True)

    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
        x = torch.randn(32, 64, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.every == 0:
            # Blocks for a copy of this rank's shards only; the rest runs in the background.
            # (the handle's wait() returns this rank's figures, or raises the save's error)
            store.save(state_of(model, optimizer), step, metadata={"loss": loss.item()})
    store.close()  # waits for the last save; raises its error, the same on every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
