"""Lightning ``ModelParallelStrategy`` (FSDP2 ``fully_shard``) jobs for
``tests/lightning/test_callback_sharded.py``, on CPU ranks (gloo), launched by Lightning's own
launcher (it re-runs this command for rank 1). The model, data and schedule are
``tests/jobs/lightning_job.py``'s (dropout, noise from three random streams, SGD with momentum,
StepLR), its layers sharded:

* ``kill --dir D``: 2 ranks train with a checkpoint every 3 steps and the memory tier every
  step (in ``D/mem``); at step 11 (this callback runs before IncrementalCheckpoint: memory step
  10 is the newest), once the step-9 checkpoint and memory step 10 are complete, both end at
  once with ``os._exit(KILLED)`` (no teardown).
* ``resume --dir D --out O``: 2 ranks resume ``D/run`` from the memory tier (step 10), then
  ``D/store`` (a copy of the killed run's store: another job to the memory tier) from the store
  (mid-epoch, step 9), and finish, then an uninterrupted reference run in ``D/ref``; every rank
  writes the final full weights and momentum buffers of the three runs to
  ``O/<run>_rank<r>.pt``, and rank 0 where each resumed from to ``O/result.json``.
* ``fsdp --dir D --out O``: Lightning's ``FSDPStrategy`` (FSDP1) on one GPU, in one process:
  a run interrupted at step 10 (an exception) resumes from step 9; then an uninterrupted
  reference; writes ``O/fsdp_<run>.pt`` and ``O/result.json``.
* ``one --dir D --out O``: 1 rank resumes ``D/one`` (a copy of the killed run's store) and
  writes its weights and momentum buffers as restored, and the store's own whole tensors of the
  step it resumed from, to ``O/one.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

if __package__ in (None, ""):  # run as a script: make `lightning_incremental` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint
from lightning_incremental.core import CheckpointStore
from tests.jobs.lightning_job import TinyModel

KILLED = 17


class ShardedModel(TinyModel):
    """TinyModel with each layer and the whole ``fully_shard``-ed over the data-parallel mesh
    (the last layer's single output row: one rank holds it, the other an empty shard)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def full(value: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (a collective for DTensors: every rank calls it; on one rank
    ``full_tensor`` returns the live tensor itself)."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return whole.detach().clone()


def full_state(module: L.LightningModule, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Weights and momentum buffers, whole, by parameter name."""
    optimizer = trainer.optimizers[0]
    state = {}
    for name, param in module.named_parameters():
        state[name] = full(param)
        state[f"momentum.{name}"] = full(optimizer.state[param]["momentum_buffer"])
    return state


class Exit(L.Callback):
    """Ends its process at step ``at`` once every scheduled save has committed."""

    def __init__(self, at: int, checkpoint: IncrementalCheckpoint) -> None:
        self.at = at
        self.checkpoint = checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.checkpoint.wait()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(KILLED)


class Restored(L.Callback):
    """Records the full state as the resumed run starts training."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = full_state(pl_module, trainer)


def fit(
    dirpath: Path,
    devices: int,
    callbacks: list[L.Callback] | None = None,
    ckpt: IncrementalCheckpoint | None = None,
    **checkpoint: Any,
) -> tuple[ShardedModel, L.Trainer, IncrementalCheckpoint]:
    L.seed_everything(0, verbose=False)
    module = ShardedModel()
    ckpt = ckpt or IncrementalCheckpoint(dirpath, **checkpoint)
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        accelerator="cpu",
        devices=devices,
        max_epochs=3,
        val_check_interval=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(dirpath.parent),
        callbacks=[ckpt, *(callbacks or [])],
    )
    trainer.fit(module)
    return module, trainer, ckpt


def memory(root: Path) -> dict[str, Any]:
    """The memory tier every step, in ``root/mem`` (one node)."""
    return {"memory_every_n_train_steps": 1, "memory_dir": root / "mem", "memory_replicas": 0}


def _fsdp(root: Path, out: Path) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    from tests.jobs.lightning_job import Crash, Interrupted

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # for deterministic=True

    def run(name: str, crash_at: int | None) -> tuple[TinyModel, L.Trainer, IncrementalCheckpoint]:
        L.seed_everything(0, verbose=False)
        module = TinyModel()
        ckpt = IncrementalCheckpoint(
            root / name,
            every_n_train_steps=3 if name == "run" else 0,
            save_on_exception=False,  # resume from the scheduled step 9
        )
        trainer = L.Trainer(
            strategy=FSDPStrategy(auto_wrap_policy={torch.nn.Linear}),
            accelerator="cuda",
            devices=1,
            max_epochs=3,
            val_check_interval=4,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            default_root_dir=str(root),
            callbacks=[ckpt, *([Crash(crash_at)] if crash_at is not None else [])],
        )
        try:
            trainer.fit(module)
        except Interrupted:
            pass
        return module, trainer, ckpt

    run("run", 10)
    results = {}
    for name in ("run", "ref"):
        _, trainer, ckpt = run(name, None)
        results[name] = ckpt.resumed_from
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = trainer.strategy.model
        state = dict(get_model_state_dict(model, options=whole))
        saved = get_optimizer_state_dict(model, trainer.optimizers[0], options=whole)["state"]
        for key, entry in saved.items():
            state[f"momentum.{key}"] = entry["momentum_buffer"]
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out / f"fsdp_{name}.pt")
    (out / "result.json").write_text(json.dumps({"resumed_from": results["run"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["kill", "resume", "one", "fsdp"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir)
    if args.scenario == "kill":
        ckpt = IncrementalCheckpoint(root / "run", every_n_train_steps=3, **memory(root))
        fit(root / "run", 2, [Exit(11, ckpt)], ckpt)
        raise SystemExit("not killed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scenario == "fsdp":
        _fsdp(root, out)
        return
    if args.scenario == "resume":
        results = {}
        for name, schedule in (("run", 3), ("store", 3), ("ref", 0)):
            every = {"every_n_train_steps": schedule, **memory(root)}
            module, trainer, ckpt = fit(root / name, 2, **every)
            state = full_state(module, trainer)
            torch.save(state, out / f"{name}_rank{trainer.global_rank}.pt")
            results[name] = [ckpt.resumed_from, ckpt.resumed_tier]
        if trainer.is_global_zero:
            (out / "result.json").write_text(json.dumps({"resumed_from": results}))
        return
    restored = Restored()
    _, _, ckpt = fit(root / "one", 1, [restored], every_n_train_steps=3)
    with CheckpointStore(root / "one") as store:
        step = ckpt.resumed_from
        saved = store.load(step)
    stored = {}
    for name, value in saved["state_dict"].items():
        stored[name] = value
        stored[f"momentum.{name}"] = saved["optimizer_states"][0]["state"][name]["momentum_buffer"]
    torch.save({"step": step, "restored": restored.state, "stored": stored}, out / "one.pt")


if __name__ == "__main__":
    main()
    # Every rank has written its results: end without the interpreter's teardown. The gloo
    # groups of the device meshes the two fits built stay referenced by their modules, and
    # destroying them at teardown (C++ threads still joinable) aborted the process now and
    # then ("terminate called without an active exception", after all work was done), even
    # after destroy_process_group: torch's teardown, not the checkpoint under test.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
