"""A Lightning DDP job over two torchrun agents (two nodes, of one or two processes each) with the
memory tier every step and the store every 10 steps, for ``tests/multiprocess/test_memory_tier.py``
(two processes a node) and ``benchmarks.suites.recovery`` (one).

``python -m torch.distributed.run --nnodes=2 --nproc-per-node=P ... tests/jobs/memory_job.py
--dir D --out O [--kill RANK:STEP[:wipe|:node|:all] ...] [--memory-every N] [--no-reference]``, each
agent with its own ``LIGHTNING_INCREMENTAL_MEMORY_DIR`` (``--memory-every 0``: the store alone, for
``benchmarks.suites.recovery``).

Unless ``--no-reference``, the first incarnation first trains an uninterrupted reference (memory
tier off, its own store) and saves each rank's final weights to ``O/ref_rank<r>.pt``; then the
run under test starts.
Each ``--kill`` SIGKILLs RANK's training process (``@NAME``: the rank whose memory directory is
named NAME) when it reaches STEP, once in the job, after its memory step in flight is
replicated (its agent restarts the group); with ``wipe`` it first empties its node's memory
directory (as a replacement node would find it), with ``all`` every node's (both nodes lost: the
store; one process empties them all once every rank's part and replica is written, so that no
second kill races the first); with ``node`` it also SIGKILLs its agent (a lost node: the test
starts a replacement). Each agent counts its
own restarts (one whose workers stop for another node's failure does not count it), so files,
not ``TORCHELASTIC_RESTART_COUNT``, say what already happened. The incarnation that finishes
writes ``O/final_rank<r>.pt``. Events (starts with ``resumed_from``, ``resumed_tier`` and the
node's memory directory; the kills, with the size of each part the node's memory held and
whether it holds the optimizer state; the end) go to ``O/events.jsonl``. The run is 2 epochs
of 16 steps with one or two processes a node; DDP's gradient buckets are fixed
(``find_unused_parameters``: see ``tests/jobs/memory_accelerate_job.py``), so that a restart
reduces in the same order, and it does not broadcast buffers: the model keeps a buffer of each
rank's own inputs, which every resume must give back to its rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental import IncrementalCheckpoint
from lightning_incremental.runtime.memory.tier import ENV
from tests.jobs import two_nodes
from tests.jobs.lightning_job import TinyModel, weights
from tests.jobs.torchrun_job import TIMINGS, Events


class Kill(L.Callback):
    def __init__(self, ckpt: IncrementalCheckpoint, spec: str, events: Events, out: Path) -> None:
        who, step, *how = spec.split(":")
        self.ckpt, self.who, self.step = ckpt, who, int(step)
        self.wipe, self.node = bool(how), how == ["node"]  # node: its agent too (and wipe)
        self.everywhere = how == ["all"]
        self.events, self.once = events, out / f"killed-{who}-{step}"

    def _chosen(self, trainer: L.Trainer) -> bool:
        if self.who.startswith("@"):  # the rank whose memory directory has this name
            return Path(os.environ[ENV]).name == self.who[1:]
        return trainer.global_rank == int(self.who)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self._chosen(trainer):
            try:
                self.once.touch(exist_ok=False)
            except FileExistsError:
                return
            self.ckpt.wait()
            memory = Path(os.environ[ENV])
            parts = two_nodes.parts_held(memory, "optimizer_states")
            if self.wipe:
                two_nodes.empty(memory, every_node=self.everywhere)
            self.events("kill", step=self.step, wiped=self.wipe, node=self.node, parts=parts)
            if self.node:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def __init__(self, ckpt: IncrementalCheckpoint, events: Events) -> None:
        self.ckpt, self.events = ckpt, events

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events(
            "started",
            step=trainer.global_step,
            resumed_from=self.ckpt.resumed_from,
            resumed_tier=self.ckpt.resumed_tier,
            node=os.environ[ENV],
        )


def fit(store: Path, out: Path, callbacks: list[L.Callback], **memory: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    ckpt = IncrementalCheckpoint(store, every_n_train_steps=10, **TIMINGS, **memory)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(
        max_epochs=2,
        limit_val_batches=0,
        accelerator="cpu",
        devices=per_node,
        num_nodes=2,
        strategy=DDPStrategy(find_unused_parameters=True, broadcast_buffers=False),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[ckpt, *[cb(ckpt) for cb in callbacks]],
    )
    # 16 steps an epoch on each rank; a buffer of each rank's own inputs
    module = TinyModel(batch_size=2 // per_node, counting=True)
    trainer.fit(module)
    torch.save(weights(module), out / f"{store.name}_rank{trainer.global_rank}.pt")
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--memory-every", type=int, default=1, help="0: the store alone")
    parser.add_argument("--no-reference", action="store_true", help="train no reference first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, root = Path(args.out), Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    events = Events(out)
    world = int(os.environ["WORLD_SIZE"])
    references = all((out / f"ref_rank{r}.pt").exists() for r in range(world))
    if not args.no_reference and not references:
        fit(root / "ref", out, [])
    kills = [lambda ckpt, spec=spec: Kill(ckpt, spec, events, out) for spec in args.kill]
    trainer = fit(
        root / "final",
        out,
        [lambda ckpt: Record(ckpt, events), *kills],
        memory_every_n_train_steps=args.memory_every or None,
    )
    events("finished", step=trainer.global_step)
    trainer.strategy.barrier()
    logging.shutdown()
    os._exit(0)  # without gloo's teardown at exit (see torchrun_job)


if __name__ == "__main__":
    main()
