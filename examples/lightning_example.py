"""IncrementalCheckpoint in a Lightning script: incremental checkpoints and exact automatic resume.

Train a small classifier (dropout, a shuffled DataLoader, AdamW, a cosine schedule) with one added
callback::

    python examples/lightning_example.py --dir /tmp/li-example

Simulate a crash, then run the very same command again: it resumes from the newest committed
checkpoint — mid-epoch, with every random state restored — and ends with the weights an
uninterrupted run would have::

    python examples/lightning_example.py --dir /tmp/li-example --crash-at 70
    python examples/lightning_example.py --dir /tmp/li-example

``--crash-at N`` kills the process (SIGKILL, like a machine dying) at step N. The figures of every
save (bytes written, ratio to the logical bytes, seconds the training loop was blocked) go to the
trainer's loggers: here a CSVLogger under ``--dir``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_incremental import IncrementalCheckpoint
from lightning_incremental.core import CheckpointStore


class Classifier(L.LightningModule):
    def __init__(self, features: int = 32, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features, self.classes = features, classes
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, self.features, generator=g)
        y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 1).long()) % self.classes
        # Shuffled with a seeded generator: a resumed epoch continues in the same order.
        return DataLoader(
            TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator()
        )


class CrashAt(L.Callback):
    """Kills the process at step ``step`` once the newest scheduled checkpoint committed."""

    def __init__(self, step: int, checkpoint: IncrementalCheckpoint) -> None:
        self.step, self.checkpoint = step, checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.checkpoint.wait()
            print(f"crashing at step {self.step} (SIGKILL): run the same command again")
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> Classifier:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("li-example"))
    parser.add_argument("--steps", type=int, default=128, help="optimizer steps (4 epochs)")
    parser.add_argument("--every", type=int, default=20, help="save every N steps")
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    checkpoint = IncrementalCheckpoint(
        args.dir / "checkpoints",
        every_n_train_steps=args.every,
        keep_last=3,  # older checkpoints are deleted once a newer one committed
    )
    callbacks: list[L.Callback] = [checkpoint]
    if args.crash_at is not None:
        callbacks.append(CrashAt(args.crash_at, checkpoint))
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=CSVLogger(args.dir, name="logs"),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier()
    trainer.fit(model)  # resumes by itself when the store holds a checkpoint

    if checkpoint.resumed_from is not None:
        print(f"resumed from step {checkpoint.resumed_from}")
    print(f"{'step':>6} {'written':>12} {'logical':>12} {'ratio':>6} {'blocked s':>10}")
    for result, blocked in checkpoint.results:
        print(
            f"{result.step:>6} {result.bytes_written:>12,} {result.bytes_logical:>12,} "
            f"{result.ratio:>6.2f} {blocked:>10.4f}"
        )
    print(f"checkpoints kept: {CheckpointStore(args.dir / 'checkpoints').steps()}")
    digest = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"weights checksum: {digest:.12f} (the same with or without a crash)")
    return model


if __name__ == "__main__":
    main()
