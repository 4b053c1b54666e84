"""A Lightning job whose world size changes between runs: ``torchrun --nproc-per-node N
tests/jobs/resize_job.py --dir D --out O [--kill-at S] ...`` (DDP over gloo when N > 1).

Every rank appends, for each training batch, the global step it belongs to and the ids of its
samples to ``O/ids_rank<r>.jsonl``. With ``--kill-at S`` every rank waits, once step ``S`` is
done, until the store has committed step ``S`` (saved at that step by ``every_n_train_steps``),
writes its weights and optimizer state to ``O/at_kill_rank<r>.pt`` and SIGKILLs itself. Without
it the run resumes from the store by itself, writes its state at the start of training to
``O/at_start_rank<r>.pt``, trains to the limit and writes ``O/result_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint
from lightning_incremental.core import CheckpointStore

# an elastic job's workers log apart per world size (torchrun's restart count does not change
# when a node joins)
INCARNATION = "" if "--elastic" not in sys.argv else os.environ.get("WORLD_SIZE", "1")


class Ids(Dataset):
    """Sample ``i`` is (features, target, i)."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 4, generator=g)
        self.y = torch.randn(samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Model(L.LightningModule):
    def __init__(
        self, samples: int, batch_size: int, shuffle: bool, out: Path, pause: float = 0.0
    ) -> None:
        super().__init__()
        self.samples, self.batch_size, self.shuffle, self.out = samples, batch_size, shuffle, out
        self.pause = pause
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        record = {"epoch": self.current_epoch, "step": self.global_step, "ids": ids.tolist()}
        with (self.out / f"ids{INCARNATION}_rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        time.sleep(self.pause)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Ids(self.samples), batch_size=self.batch_size, shuffle=self.shuffle)


def state(trainer: L.Trainer, module: nn.Module) -> dict[str, Any]:
    return {
        "step": trainer.global_step,
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
    }


class Probe(L.Callback):
    """Writes the state at the start of training; with ``kill_at``, kills this process at that
    step once the store committed it."""

    def __init__(self, out: Path, store: str, kill_at: int | None) -> None:
        self.out, self.store, self.kill_at = out, store, kill_at

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.kill_at is None:
            torch.save(state(trainer, module), self.out / f"at_start_rank{trainer.global_rank}.pt")

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *_: Any) -> None:
        # step kill_at is done and its save queued (the checkpoint's hook runs after this one's
        # on_train_batch_end, so the kill waits for the next batch to start)
        if self.kill_at is None or trainer.global_step != self.kill_at:
            return
        torch.save(state(trainer, module), self.out / f"at_kill_rank{trainer.global_rank}.pt")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with CheckpointStore(self.store) as store:
                if self.kill_at in store.steps():
                    break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--sequential", action="store_true", help="no shuffling")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep per batch")
    parser.add_argument(
        "--elastic", action="store_true", help="log per world size (ids<world>_rank<r>), DDP alone"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the world from the environment, as an elastic job must: any number of nodes
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    L.seed_everything(0, verbose=False)
    # an elastic job keeps the watchdog (its default under torchrun): a lost node is found by it
    watchdog = None if args.elastic else False
    ckpt = IncrementalCheckpoint(args.dir, every_n_train_steps=args.every, watchdog=watchdog)
    trainer = L.Trainer(
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        # elastic: DDP even alone, so that a DistributedSampler orders the data at every size
        strategy="ddp" if world > 1 or args.elastic else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
        callbacks=[Probe(out, args.dir, args.kill_at), ckpt],
    )
    module = Model(args.samples, args.batch, not args.sequential, out, args.pause)
    trainer.fit(module)
    if args.kill_at is not None:
        raise SystemExit(f"step {args.kill_at} was never reached")
    result = {"resumed_from": ckpt.resumed_from, "step": trainer.global_step}
    (out / f"result_rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if world > 1:  # end without gloo's teardown at interpreter exit (see torchrun_job.py)
        trainer.strategy.barrier()
        os._exit(0)


if __name__ == "__main__":
    main()
