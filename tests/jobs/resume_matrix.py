"""The randomized crash matrix: does a run that dies anywhere resume bit-identically?

A :class:`Case` is one training configuration (epoch length, save cadence, crash step, sampler,
validation interval, gradient accumulation, LR scheduler, step or epoch limit) drawn from a seeded
generator by :func:`cases`. :func:`run_case` trains it three ways, each in a process of its own:

* the reference: uninterrupted, to the final limit;
* the crashed run: the process ends itself with ``os._exit`` in ``on_train_batch_end`` at the
  case's step (a real crash: no teardown, no exception handler, no save at the end; optionally
  after waiting for the newest checkpoint to commit, otherwise with the save still in flight) —
  or, for an *extension* case, it finishes normally at a smaller ``max_steps``/``max_epochs``;
* the resumed run: the same command again, which resumes from the store by itself;

and compares the final weights and optimizer state, bit for bit.

The processes are forks of one driver process that imported torch and Lightning once (a fresh
interpreter per run would spend most of the matrix importing). Run as a script, the driver reads
cases as JSON and prints one JSON line per case::

    python tests/jobs/resume_matrix.py --dir D --seed 0 --count 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

if __package__ in (None, ""):  # run as a script: make `lightning_incremental` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint
from tests.jobs.lightning_job import FEATURES, NoisyData

SAMPLERS = ("shuffle_generator", "shuffle_global", "sequential", "distributed")
SCHEDULERS = ("none", "step", "epoch", "plateau_val", "plateau_train")
CADENCES = ("steps", "epochs", "time")


@dataclass(frozen=True)
class Case:
    """One configuration of the matrix (all counts are optimizer steps unless named batches)."""

    samples: int  # dataset size; the last batch may be short
    batch_size: int
    sampler: str  # one of SAMPLERS
    cadence: str  # "steps" (every_n_train_steps), "epochs" (every_n_epochs) or "time" (ms)
    every: int
    limit: str  # "max_steps" or "max_epochs"
    total: int  # the limit of the reference (and resumed) run
    val_check: int | float | str | None  # val_check_interval (None: at each epoch's end; "off")
    accumulate: int
    scheduler: str  # one of SCHEDULERS
    crash_at: int | None  # global step of the crash; None for an extension case
    wait: bool  # the crashed run waits for its newest checkpoint to commit before dying
    first_total: int | None = None  # extension case: the first run's smaller limit
    seed: int = 0

    @property
    def batches(self) -> int:
        per_rank = self.samples if self.sampler != "distributed" else -(-self.samples // 2)
        return -(-per_rank // self.batch_size)

    def label(self) -> str:
        crash = (
            f"extend {self.first_total}->{self.total}"
            if self.crash_at is None
            else f"crash@{self.crash_at}{'+wait' if self.wait else ''}"
        )
        val = "" if self.val_check is None else f" val={self.val_check}"
        acc = "" if self.accumulate == 1 else f" acc={self.accumulate}"
        return (
            f"{self.batches}b/epoch {self.sampler} every_n_{self.cadence}={self.every} "
            f"{self.limit}={self.total} sched={self.scheduler}{val}{acc} {crash}"
        )


def cases(seed: int, count: int) -> list[Case]:
    """``count`` valid cases drawn from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    found: list[Case] = []
    while len(found) < count:
        case = _draw(rng, len(found) + seed * 1000)
        if case is not None:
            found.append(case)
    return found


def _draw(rng: random.Random, index: int) -> Case | None:
    batch_size = rng.choice((4, 8))
    samples = batch_size * rng.randint(3, 7) + rng.choice((0, 0, rng.randint(1, batch_size - 1)))
    sampler = rng.choice(SAMPLERS)
    per_rank = samples if sampler != "distributed" else -(-samples // 2)
    batches = -(-per_rank // batch_size)
    accumulate = rng.choice((1, 1, 1, 2, 3))
    steps_per_epoch = -(-batches // accumulate)
    val_check: int | float | str | None = rng.choice(
        (None, "off", "off", 0.5, max(1, batches // 2), batches)
    )
    if isinstance(val_check, int) and val_check > batches:
        val_check = None
    scheduler = rng.choice(SCHEDULERS)
    if scheduler == "plateau_val" and val_check == "off":
        val_check = None
    cadence = rng.choice(CADENCES)
    if cadence == "epochs":
        every = rng.choice((1, 2))
    elif cadence == "time":  # train_time_interval in ms: which steps it saves varies by run
        every = rng.choice((1, 5, 20))
    else:
        every = rng.randint(1, steps_per_epoch + 2)
    epochs = rng.randint(2, 4)
    limit = rng.choice(("max_steps", "max_epochs"))
    if limit == "max_steps":
        total = steps_per_epoch * epochs - rng.choice((0, 0, rng.randint(0, steps_per_epoch - 1)))
    else:
        total = epochs
    extension = rng.random() < 0.2
    total_steps = total if limit == "max_steps" else total * steps_per_epoch
    common = (samples, batch_size, sampler, cadence, every, limit, total, val_check)
    if extension:
        first = rng.randint(1, total - 1)  # steps or epochs, as the limit
        return Case(*common, accumulate, scheduler, None, False, first, index)
    if total_steps < 3:
        return None
    crash_at = rng.randint(2, total_steps - 1)
    wait = rng.random() < 0.6
    return Case(*common, accumulate, scheduler, crash_at, wait, None, index)


# ---------------------------------------------------------------------------- the job


class MatrixModel(L.LightningModule):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.trace: list[list[float]] = []  # (epoch, batch_idx, global_step, lr, batch sum)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 12), nn.ReLU(), nn.Dropout(0.2), nn.Linear(12, 1)
        )

    def setup(self, stage: str) -> None:
        torch.manual_seed(100)
        np.random.seed(200)
        random.seed(300)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.trace.append([self.current_epoch, batch_idx, self.global_step, lr, float(x.sum())])
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        kind = self.case.scheduler
        if kind == "none":
            return opt
        if kind == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "epoch":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        # mode="max" on a loss: the LR drops at (nearly) every check, so a missed or extra
        # scheduler step shows in the weights.
        monitor = "val_loss" if kind == "plateau_val" else "train_loss"
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, mode="max", factor=0.5, patience=0
        )
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "interval": "epoch", "monitor": monitor},
        }

    def train_dataloader(self) -> DataLoader:
        case, data = self.case, NoisyData(self.case.samples)
        if case.sampler == "distributed":
            sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=7)
            return DataLoader(data, batch_size=case.batch_size, sampler=sampler)
        seeded = case.sampler == "shuffle_generator"
        generator = torch.Generator().manual_seed(3) if seeded else None
        return DataLoader(
            data,
            batch_size=case.batch_size,
            shuffle=case.sampler != "sequential",
            generator=generator,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(NoisyData(8), batch_size=4)


class Crash(L.Callback):
    """Ends the process with ``os._exit`` at the end of the batch that reaches ``step``."""

    def __init__(self, step: int, wait: bool, checkpoint: IncrementalCheckpoint) -> None:
        self.step, self.wait, self.checkpoint = step, wait, checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            if self.wait:
                self.checkpoint.wait()
            os._exit(9)


def train(case: Case, dirpath: Path, *, total: int, crash: bool) -> dict[str, torch.Tensor]:
    """One ``fit`` of the case; returns the final weights and optimizer state."""
    ckpt_args: dict[str, Any] = {
        "steps": {"every_n_train_steps": case.every},
        "epochs": {"every_n_epochs": case.every},
        "time": {"train_time_interval": timedelta(milliseconds=case.every)},
    }[case.cadence]
    ckpt = IncrementalCheckpoint(dirpath, **ckpt_args)
    callbacks: list[L.Callback] = [ckpt]
    if crash and case.crash_at is not None:
        callbacks.append(Crash(case.crash_at, case.wait, ckpt))
    limits = (
        {"max_steps": total, "max_epochs": -1}
        if case.limit == "max_steps"
        else {"max_epochs": total}
    )
    L.seed_everything(case.seed, verbose=False)
    model = MatrixModel(case)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=None if case.val_check == "off" else case.val_check,
        limit_val_batches=0 if case.val_check == "off" else None,
        check_val_every_n_epoch=1,
        accumulate_grad_batches=case.accumulate,
        use_distributed_sampler=False,
        default_root_dir=str(dirpath.parent),
        callbacks=callbacks,
        **limits,
    )
    trainer.fit(model)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    opt = trainer.optimizers[0].state_dict()
    for index, values in opt["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"opt.{index}.{name}"] = value.clone()
    state["lr"] = torch.tensor([g["lr"] for g in opt["param_groups"]], dtype=torch.float64)
    state["global_step"] = torch.tensor(trainer.global_step)
    state["trace"] = torch.tensor(model.trace, dtype=torch.float64)
    return state


def _in_child(fn: Any, out: Path) -> int:
    """Run ``fn`` in a forked child that writes its result to ``out``; the child's exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            torch.save(fn(), out)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_case(case: Case, root: Path) -> dict[str, Any]:
    """Reference, crashed (or shorter) run and resumed run of ``case``; the verdict."""
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ref = root / "ref.pt"
    code = _in_child(lambda: train(case, root / "ref", total=case.total, crash=False), ref)
    if code != 0:
        return {"case": asdict(case), "ok": False, "error": f"reference exited {code}"}
    store = root / "run"
    if case.crash_at is not None:
        code = _in_child(lambda: train(case, store, total=case.total, crash=True), root / "x.pt")
        if code != 9:
            return {"case": asdict(case), "ok": False, "error": f"crashed run exited {code}"}
    else:
        assert case.first_total is not None
        code = _in_child(
            lambda: train(case, store, total=case.first_total, crash=False), root / "first.pt"
        )
        if code != 0:
            return {"case": asdict(case), "ok": False, "error": f"first run exited {code}"}
    res = root / "resumed.pt"
    code = _in_child(lambda: train(case, store, total=case.total, crash=False), res)
    if code != 0:
        return {"case": asdict(case), "ok": False, "error": f"resumed run exited {code}"}
    a, b = torch.load(res), torch.load(ref)
    trace_a, trace_b = a.pop("trace"), b.pop("trace")
    differ = sorted(k for k in b if k not in a or not torch.equal(a[k], b[k]))
    return {
        "case": asdict(case),
        "label": case.label(),
        "ok": not differ,
        "differ": differ[:5],
        "first_divergence": _first_divergence(trace_a, trace_b) if differ else None,
        "seconds": round(time.monotonic() - started, 2),
    }


def _first_divergence(resumed: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Where the resumed run's training steps first differ from the reference's (matched from
    the end: both runs finish at the same point)."""
    a, b = resumed.tolist(), reference.tolist()
    offset = len(b) - len(a)
    if offset < 0:
        return f"the resumed run trained {len(a)} batches, the reference only {len(b)} in all"
    for i, row in enumerate(a):
        if row != b[offset + i]:
            names = ("epoch", "batch_idx", "step", "lr", "batch_sum")
            return (
                f"resumed batch {i}: {dict(zip(names, row))} != reference "
                f"{dict(zip(names, b[offset + i]))}"
            )
    return "the same batches in the same order; state other than the batches differs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--cases", help="JSON list of Case fields (instead of --seed/--count)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = (
        [Case(**c) for c in json.loads(args.cases)] if args.cases else cases(args.seed, args.count)
    )
    for index, case in enumerate(chosen):
        result = run_case(case, Path(args.dir) / f"case{index}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
