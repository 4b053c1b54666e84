"""A Lightning DDP job for ``torchrun --nproc-per-node 2 --max-restarts 2``, with faults on cue.

``python -m torch.distributed.run ... tests/jobs/torchrun_job.py --dir D --out O [--fault F ...]``

Each ``--fault RESTART:RANK:STEP:KIND`` fires once, in the run whose
``TORCHELASTIC_RESTART_COUNT`` is RESTART, on RANK, when training reaches STEP:

* ``kill``: the rank SIGKILLs itself (a machine that dies);
* ``stop``: the rank SIGSTOPs itself (a machine that freezes: a zombie); the test sends SIGCONT
  once the others have given up on it;
* ``commit``: rank 0 SIGKILLs itself while committing checkpoint STEP, after the checkpoint's
  data is written and before its manifest is (the background writer's put of the manifest);
* ``flip``: the rank flips one bit of one weight (a silent memory error), right before the
  checkpoint of STEP checks the replicas (``--replica-check``);
* ``hang``: the rank stops making progress (sleeps, its heartbeat thread still running: a
  deadlock in data loading, a stuck filesystem), and the others wait for it in the next
  collective;
* ``cut``: the rank records that its link to the job's TCPStore is to be cut, and trains on,
  a second per batch from then on (so that training outlasts the heartbeat timeout); the
  test's forwarder (``LI_TEST_STORE_PROXY``: its port), which that rank's store clients go
  through in the first run, then stops forwarding (a partition: only the store link).

Every run records its events (pids, faults, watchdog findings, resumes) as JSON lines in
``O/events.jsonl``; the run that finishes writes each rank's final weights to
``O/final_rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
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

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
TIMINGS = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0, "progress_timeout": 6.0}


class Events:
    """Appends one JSON line per event (O_APPEND: lines of both ranks never interleave)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "events.jsonl"

    def __call__(self, event: str, **fields: Any) -> None:
        fields.update(event=event, restart=RESTART, pid=os.getpid(), time=time.time())
        fields.setdefault("rank", int(os.environ.get("RANK", "-1")))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(fields) + "\n").encode())
        finally:
            os.close(fd)


class WatchdogLog(logging.Handler):
    """Records the watchdog's finding (logged right before it ends the process)."""

    def __init__(self, events: Events) -> None:
        super().__init__(logging.WARNING)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("watchdog on rank"):
            self.events("watchdog", message=message)
        elif message.startswith("Replica divergence"):
            self.events("replicas", message=message)


class Faults(L.Callback):
    """Fires this run's faults (see the module docstring)."""

    def __init__(self, faults: list[tuple[int, int, int, str]], events: Events) -> None:
        self.mine = [(step, kind) for restart, rank, step, kind in faults if restart == RESTART]
        self.events = events

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rank = trainer.global_rank
        self.mine = [(s, k) for s, k in self.mine if self._rank_of(s, k) == self.rank]
        for step, kind in self.mine:
            if kind == "commit":
                self._kill_at_commit(trainer, step)

    def _rank_of(self, step: int, kind: str) -> int:
        for restart, rank, s, k in FAULTS:
            if restart == RESTART and (s, k) == (step, kind):
                return rank
        raise AssertionError

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for step, kind in self.mine:
            if trainer.global_step == step and kind == "flip":
                weight = trainer.lightning_module.net[0].weight.data  # type: ignore[index]
                weight.view(torch.int32).view(-1)[3] ^= 1 << 7
                self.events("signal", kind=kind, step=step)
            if trainer.global_step == step and kind == "hang":
                self.events("signal", kind=kind, step=step)
                time.sleep(600)
            if trainer.global_step == step and kind == "cut":
                self.events("signal", kind=kind, step=step)
            if trainer.global_step >= step and kind == "cut":
                time.sleep(1.0)
            if trainer.global_step == step and kind in ("kill", "stop"):
                self.events("signal", kind=kind, step=step)
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                self.events("woke", step=step)

    def _kill_at_commit(self, trainer: L.Trainer, step: int) -> None:
        ckpt = next(cb for cb in trainer.callbacks if isinstance(cb, IncrementalCheckpoint))  # type: ignore[attr-defined]
        saver = ckpt._fit.saver
        store = saver.store if saver is not None else None
        assert store is not None, "only rank 0 commits"
        put = store.storage.put
        target = f"manifests/{step:020d}.json"
        events = self.events

        def put_or_die(path: str, data: Any, **kwargs: Any) -> bool:
            if path == target:
                events("signal", kind="commit", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            return put(path, data, **kwargs)

        store.storage.put = put_or_die  # type: ignore[method-assign]


class Record(L.Callback):
    def __init__(self, events: Events) -> None:
        self.events = events

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ckpt = next(cb for cb in trainer.callbacks if isinstance(cb, IncrementalCheckpoint))  # type: ignore[attr-defined]
        self.events(
            "started",
            rank=trainer.global_rank,
            step=trainer.global_step,
            resumed_from=ckpt.resumed_from,
            generation=ckpt.generation,
        )


FAULTS: list[tuple[int, int, int, str]] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--replica-check", default="warn")
    args = parser.parse_args()
    for spec in args.fault:
        restart, rank, step, kind = spec.split(":")
        assert kind in ("kill", "stop", "commit", "flip", "hang", "cut"), kind
        FAULTS.append((int(restart), int(rank), int(step), kind))
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    events = Events(out)
    proxy = os.environ.get("LI_TEST_STORE_PROXY")
    cut_rank = {rank for restart, rank, _, kind in FAULTS if restart == RESTART and kind == "cut"}
    if proxy and int(os.environ["RANK"]) in cut_rank:
        # This rank reaches the job's store only through the test's forwarder, which learns
        # where to forward from this file.
        (out / "upstream").write_text(os.environ["MASTER_PORT"])
        os.environ["MASTER_PORT"] = proxy
    logging.getLogger("lightning_incremental").addHandler(WatchdogLog(events))
    L.seed_everything(0, verbose=False)
    ckpt = IncrementalCheckpoint(
        args.dir, every_n_train_steps=2, replica_check=args.replica_check, **TIMINGS
    )
    trainer = L.Trainer(
        max_epochs=3,
        val_check_interval=4,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[ckpt, Faults(FAULTS, events), Record(events)],
    )
    module = TinyModel()
    trainer.fit(module)
    torch.save(weights(module), out / f"final_rank{trainer.global_rank}.pt")
    events("finished", rank=trainer.global_rank, step=trainer.global_step)
    # Both ranks are done; end without gloo's teardown at interpreter exit, which now and then
    # aborts a process ("terminate called without an active exception") and would count as a
    # failure to restart.
    trainer.strategy.barrier()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
