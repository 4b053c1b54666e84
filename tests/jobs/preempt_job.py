"""A Lightning job to preempt: ``python tests/jobs/preempt_job.py --dir D --out O`` (one process)
or under ``torchrun --nproc-per-node 2`` (DDP over gloo).

Trains the tiny model (dropout, shuffled data) for 24 steps (3 epochs of 8 on one process) with
``IncrementalCheckpoint(every_n_train_steps=10)``, a little slowly (so that a test can signal it
mid-run), appending each finished step to ``O/progress_rank<r>.txt`` (and, with ``--validate``,
validating 4 batches every 4 steps, each ``val<step>``). A run that finishes writes
``O/final_rank<r>.pt`` (weights and optimizer state) and ``O/result_rank<r>.json`` (the step it
resumed from).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint
from tests.jobs.lightning_job import TinyModel, weights


class Progress(L.Callback):
    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"progress_rank{rank}.txt"

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        with self.path.open("a") as f:
            f.write(f"{trainer.global_step}\n")
        time.sleep(0.1)  # time for the test to send its signal mid-run

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            with self.path.open("a") as f:
                f.write(f"val{trainer.global_step}\n")
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--validate", action="store_true", help="validate every 4 steps")
    parser.add_argument("--workers", type=int, default=0, help="persistent DataLoader workers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    L.seed_everything(0, verbose=False)
    ckpt = IncrementalCheckpoint(args.dir, every_n_train_steps=10)
    trainer = L.Trainer(
        max_epochs=3 * world,  # 24 steps whatever the world size
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=4 if args.validate else 0,
        val_check_interval=4 if args.validate else None,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
        callbacks=[ckpt, Progress(out, rank)],
    )
    module = TinyModel(num_workers=args.workers, persistent_workers=args.workers > 0)
    trainer.fit(module)
    final = {"weights": weights(module), "optimizer": trainer.optimizers[0].state_dict()}
    torch.save(final, out / f"final_rank{rank}.pt")
    result = {"resumed_from": ckpt.resumed_from, "step": trainer.global_step}
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    if world > 1:  # end without gloo's teardown at interpreter exit (see torchrun_job.py)
        trainer.strategy.barrier()
        os._exit(0)


if __name__ == "__main__":
    main()
