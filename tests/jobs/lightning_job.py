"""Tiny Lightning training jobs for ``tests/lightning/test_callback.py``.

Importable (the model, its data, the interrupting callbacks, ``fit``) and runnable as a script for
the runs that need their own processes:

* ``python tests/jobs/lightning_job.py single --dir D --out O [--kill-at N]``: one CPU process; with
  ``--kill-at`` the process SIGKILLs itself at step N once the newest scheduled checkpoint has
  committed. Without it, the run resumes from ``D/run`` (if there is a checkpoint), finishes, runs
  an uninterrupted reference in ``D/ref`` and writes ``O/result.json``.
* ``python tests/jobs/lightning_job.py ddp --dir D --out O``: DDP with 2 CPU ranks (gloo), launched
  by Lightning's own launcher (it re-runs this command for rank 1). In one launch: an uninterrupted
  reference, a run interrupted mid-epoch and resumed, runs interrupted after an epoch-boundary
  checkpoint and resumed (epoch- and step-limited); every rank writes its final weights (and its
  own buffer of the inputs it saw: ``broadcast_buffers=False``) to ``O/<run>_rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

if __package__ in (None, ""):  # run as a script: make `lightning_incremental` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint

SAMPLES, FEATURES = 64, 8


class Interrupted(RuntimeError):
    """Raised by :class:`Crash` to interrupt a run."""


class NoisyData(Dataset):
    """Fixed samples plus noise drawn at every read from torch, numpy and Python's ``random``:
    a resumed run is bit-identical only if all three streams are restored."""

    def __init__(self, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, FEATURES, generator=g)
        self.y = torch.randn(samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.01 * torch.randn(FEATURES) + 0.001 * float(np.random.randn())
        return self.x[i] + noise + 0.001 * random.random(), self.y[i]


class StatefulLoader(DataLoader):
    """A stateful dataloader (``state_dict``/``load_state_dict``, like torchdata's
    StatefulDataLoader): it records its epoch's generator state and its position, and skips
    without reading. Lightning restores it; IncrementalCheckpoint must leave it alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._consumed = 0
        self._epoch_start: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        assert self.generator is not None
        pending, self._pending = self._pending, None
        if pending is not None:
            self.generator.set_state(pending["epoch_start"])
        self._epoch_start = self.generator.get_state()
        batches = iter(self.batch_sampler)  # type: ignore[arg-type]
        self._consumed = pending["consumed"] if pending else 0
        for _ in range(self._consumed):
            next(batches)
        for indices in batches:
            self._consumed += 1
            yield self.collate_fn([self.dataset[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._consumed, "epoch_start": self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state


class TinyModel(L.LightningModule):
    """Linear-ReLU-Dropout-Linear, SGD with momentum and a StepLR schedule.

    Args:
        shuffle: "generator" (a seeded ``torch.Generator``), "global" (the global torch RNG),
            "none" (sequential) or "stateful" (a :class:`StatefulLoader` over the whole data,
            each rank its own order: its state differs from rank to rank; under DDP without
            Lightning's distributed sampler).
        num_workers / persistent_workers: of the training DataLoader.
        hidden: width of the hidden layer (a different width is a different model).
        counting: keep a buffer, ``seen``, of the sum of the inputs this rank trained on (each
            rank's differs under DDP with ``broadcast_buffers=False``).
    """

    def __init__(
        self,
        shuffle: str = "generator",
        num_workers: int = 0,
        persistent_workers: bool = False,
        hidden: int = 16,
        batch_size: int = 8,
        counting: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1)
        )
        self.counting = counting  # not from hparams: a test may replace them
        if counting:
            self.register_buffer("seen", torch.zeros(FEATURES))

    def setup(self, stage: str) -> None:
        # Each rank its own random streams (dropout, noise), the same in every run.
        torch.manual_seed(100 + self.global_rank)
        np.random.seed(200 + self.global_rank)
        random.seed(300 + self.global_rank)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.counting:
            self.seen += x.detach().sum(0)
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if hp.shuffle == "stateful":
            own = torch.Generator().manual_seed(3 + self.global_rank)
            return StatefulLoader(
                NoisyData(), batch_size=hp.batch_size, shuffle=True, generator=own
            )
        generator = torch.Generator().manual_seed(3) if hp.shuffle == "generator" else None
        return DataLoader(
            NoisyData(),
            batch_size=hp.batch_size,
            shuffle=hp.shuffle != "none",
            generator=generator,
            num_workers=hp.num_workers,
            persistent_workers=hp.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(NoisyData(16), batch_size=8)


class Crash(L.Callback):
    """Raises :class:`Interrupted` at the end of training step ``at`` (``hook`` can move it)."""

    def __init__(self, at: int, hook: str = "on_train_batch_end") -> None:
        self.at = at
        setattr(self, hook, self._maybe_crash)

    def _maybe_crash(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == self.at:
            raise Interrupted(f"interrupted at step {self.at}")


class Killer(L.Callback):
    """SIGKILLs its own process at step ``at`` once every scheduled save has committed."""

    def __init__(self, at: int, checkpoint: IncrementalCheckpoint) -> None:
        self.at = at
        self.checkpoint = checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.checkpoint.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def fit(
    dirpath: str | Path,
    *,
    crash_at: int | None = None,
    model: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    callbacks: list[L.Callback] | None = None,
    seed: int = 0,
    ckpt_path: str | None = None,
    **checkpoint_args: Any,
) -> tuple[TinyModel, L.Trainer, IncrementalCheckpoint]:
    """One ``trainer.fit`` of :class:`TinyModel` with an :class:`IncrementalCheckpoint` at
    ``dirpath``; an :class:`Interrupted` crash at ``crash_at`` is caught (see ``trainer.state``).
    """
    L.seed_everything(seed, verbose=False)
    module = TinyModel(**(model or {}))
    ckpt = IncrementalCheckpoint(dirpath, **checkpoint_args)
    extra = list(callbacks or [])
    if crash_at is not None:
        extra.append(Crash(crash_at))
    options: dict[str, Any] = {
        "max_epochs": 3,
        "val_check_interval": 4,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(Path(dirpath).parent),
    }
    options.update(trainer or {})
    run = L.Trainer(callbacks=[ckpt, *extra], **options)
    try:
        run.fit(module, ckpt_path=ckpt_path)
    except Interrupted:
        if crash_at is None:
            raise
    return module, run, ckpt


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _single(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    run_dir, out = Path(args.dir) / "run", Path(args.out)
    if args.kill_at is not None:
        ckpt = IncrementalCheckpoint(run_dir, every_n_train_steps=3)
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            max_epochs=3,
            val_check_interval=4,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ckpt, Killer(args.kill_at, ckpt)],
        )
        trainer.fit(TinyModel())
        raise SystemExit("not killed")
    resumed, _, ckpt = fit(run_dir, every_n_train_steps=3)
    reference, _, _ = fit(Path(args.dir) / "ref", every_n_train_steps=3)
    a, b = weights(resumed), weights(reference)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "resumed_from": ckpt.resumed_from,
        "equal": all(torch.equal(a[k], b[k]) for k in b) and a.keys() == b.keys(),
    }
    (out / "result.json").write_text(json.dumps(result))


def _ddp(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    root, out = Path(args.dir), Path(args.out)
    counting = {"counting": True}
    resumed: dict[str, Any] = {}

    def ddp(**more: Any) -> dict[str, Any]:  # each rank's buffers its own (a strategy a fit)
        strategy = DDPStrategy(broadcast_buffers=False)
        return {"accelerator": "cpu", "devices": 2, "strategy": strategy, **more}

    def save(name: str, module: TinyModel, trainer: L.Trainer) -> None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(weights(module), out / f"{name}_rank{trainer.global_rank}.pt")

    module, trainer, _ = fit(root / "ref", trainer=ddp(), model=counting, every_n_train_steps=0)
    save("ref", module, trainer)
    # Each rank reads 4 batches per epoch (its half of the data, Lightning's DistributedSampler).
    steps = {"max_steps": 12, "max_epochs": -1}  # the same 12 steps, iteration-based
    for name, crash_at, options, schedule in (
        ("mid", 10, {}, {"every_n_train_steps": 3}),  # resumes from step 9: batch 1 of epoch 2
        ("epoch", 7, {}, {"every_n_epochs": 1}),  # resumes from step 4: the end of epoch 0
        ("epoch_steps", 11, steps, {"every_n_epochs": 1}),  # from step 8: the end of epoch 1
    ):
        fit(root / name, crash_at=crash_at, trainer=ddp(**options), model=counting, **schedule)
        module, trainer, ckpt = fit(root / name, trainer=ddp(**options), model=counting, **schedule)
        save(name, module, trainer)
        resumed[name] = ckpt.resumed_from
    # Stateful loaders, each rank its own order (no distributed sampler): each rank's loader
    # state, not rank 0's (the checkpoint's loops), must come back to it.
    stateful, alone = {"counting": True, "shuffle": "stateful"}, {"use_distributed_sampler": False}
    module, trainer, _ = fit(
        root / "sref", trainer=ddp(**alone), model=stateful, every_n_train_steps=0
    )
    save("stateful_ref", module, trainer)
    fit(root / "stateful", crash_at=10, trainer=ddp(**alone), model=stateful, every_n_train_steps=3)
    module, trainer, ckpt = fit(
        root / "stateful", trainer=ddp(**alone), model=stateful, every_n_train_steps=3
    )
    save("stateful", module, trainer)
    resumed["stateful"] = ckpt.resumed_from
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"resumed_from": resumed}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["single", "ddp"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    {"single": _single, "ddp": _ddp}[args.scenario](args)


if __name__ == "__main__":
    main()
