"""A Hugging Face ``Trainer`` over two torchrun agents (two nodes, one process each) with the
memory tier every step and the store every 10 steps (``enable_trainer``), for
``tests/multiprocess/test_trainer_memory_tier.py``.

``python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 ...
tests/jobs/memory_trainer_job.py --dir D --out O [--kill RANK:STEP[:wipe|:all] ...]``, each agent
with its own ``LIGHTNING_INCREMENTAL_MEMORY_DIR``.

The first incarnation first trains an uninterrupted reference (memory tier off, its own store
and output folder) and writes each process's final state to ``O/ref_rank<r>.pt``; then the run
under test starts. Each ``--kill`` SIGKILLs RANK's training process at ``on_step_end`` of STEP,
once the memory step before it is taken and replicated (once in the job; its agent restarts the
group); with ``wipe`` it first empties its node's memory directory, so that its part must come
from the other node's replica; with ``all`` every node's (the store serves). The incarnation
that finishes writes ``O/final_rank<r>.pt``. Events (starts, with ``resumed_from`` and
``resumed_tier``; the kills; the end) go to ``O/events.jsonl``.

GPT-2 has dropout and each process draws its own batches (the Trainer's distributed sampler):
the run ends bit-identical to the reference only if the weights, the optimizer, the scheduler,
the data position and each process's random state all come back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_incremental import enable_trainer
from lightning_incremental.runtime.memory.tier import ENV
from tests.jobs import two_nodes
from tests.jobs.torchrun_job import Events

STEPS, SAVE = 24, 10  # 48 samples, 4 a batch and 2 processes: 6 steps an epoch


class Kill(TrainerCallback):
    """SIGKILLs this process at ``on_step_end`` of the kill's step (see the module's notes)."""

    def __init__(self, holder: list[Any], specs: list[str], events: Events, out: Path) -> None:
        self.holder, self.specs, self.events, self.out = holder, specs, events, out

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        for spec in self.specs:
            who, at, *how = spec.split(":")
            if state.global_step != int(at):
                continue
            # every process (the checkpointer's wait is a collective): the memory step before
            # this one written and replicated, the store's saves committed
            self.holder[0].wait()
            if args.process_index != int(who):
                continue
            try:
                (self.out / f"killed-{who}-{at}").touch(exist_ok=False)
            except FileExistsError:  # once in the job
                continue
            memory = Path(os.environ[ENV])
            self.events("kill", step=state.global_step, wiped=bool(how), node=str(memory))
            if how:
                two_nodes.empty(memory, every_node=how == ["all"])
            os.kill(os.getpid(), signal.SIGKILL)


class Started(TrainerCallback):
    """Records where the run resumed from, once the Trainer restored it (``on_train_begin``)."""

    def __init__(self, holder: list[Any], events: Events) -> None:
        self.holder, self.events = holder, events

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        ckpt = self.holder[0]
        self.events(
            "started", step=state.global_step, resumed_from=ckpt.resumed_from,
            resumed_tier=ckpt.resumed_tier, node=os.environ[ENV],
        )  # fmt: skip


def train(
    root: Path, name: str, kills: list[str], events: Events | None, out: Path, **memory: Any
) -> Any:
    """One run of the Trainer into ``root/name`` (its store) and ``root/name-out`` (its
    folders); returns this process's final state."""
    set_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(1234))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(
        output_dir=str(root / f"{name}-out"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE,
        learning_rate=1e-3,
        logging_steps=1000,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    holder: list[Any] = []
    callbacks: list[TrainerCallback] = []
    if events is not None:
        callbacks = [Started(holder, events), Kill(holder, kills, events, out)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    ckpt = enable_trainer(trainer, str(root / name), **memory)
    assert ckpt is not None
    holder.append(ckpt)
    trainer.train()
    return {
        "step": trainer.state.global_step,
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }


def main() -> None:
    args, out, root = two_nodes.job_arguments(__doc__)
    torch.set_num_threads(1)
    logging.basicConfig(format="%(name)s: %(message)s")
    events = Events(out)
    two_nodes.reference_then_final(
        out,
        events,
        reference=lambda: train(root, "ref", [], None, out),
        final=lambda: train(root, "final", args.kill, events, out, memory_every_n_steps=1),
    )


if __name__ == "__main__":
    main()
