"""A ``transformers.Trainer`` script as users write it (no line of ours): a tiny GPT-2 built from
a config (no download), random token ids, ``TrainingArguments(save_steps=..., max_steps=...)``.

Run as ``python hf_trainer_job.py`` (the Trainer's own checkpoints) or under ``accelerate launch
... -m accelerate_incremental --dirpath STORE hf_trainer_job.py`` (the same script, incremental).

Options: ``--output-dir`` (the Trainer's), ``--out`` (final weights and optimizer state, written by
the main process), ``--crash-after K`` (SIGKILL every process at global step K, once the saves
before it committed), ``--resume`` (``train(resume_from_checkpoint=...)``: ``true`` or a path),
``--slow S --progress P`` (each process sleeps S seconds after each step, then appends the step to
``P.rank<r>``: time for a test to signal it mid-run). Each process prints ``JOB DONE`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

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

SAMPLES, LENGTH, VOCAB = 48, 16, 512


class Crash(TrainerCallback):
    """SIGKILLs this process at global step ``at``, after the checkpoints saved so far committed
    (on every process: each waits for the others first)."""

    def __init__(self, trainer_ref: list[Trainer], at: int) -> None:
        self.trainer_ref = trainer_ref
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.at:
            import accelerate_incremental

            trainer = self.trainer_ref[0]
            accelerate_incremental.enable_trainer(trainer).wait()
            trainer.accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)


class Progress(TrainerCallback):
    """Appends each finished step to ``{path}.rank<r>``, after a pause of ``slow`` seconds."""

    def __init__(self, path: str, slow: float) -> None:
        self.path = f"{path}.rank{os.environ.get('RANK', '0')}"
        self.slow = slow

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        import time

        time.sleep(self.slow)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(f"{state.global_step}\n")


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--output-dir", required=True)
    cli.add_argument("--out", default=None)
    cli.add_argument("--crash-after", type=int, default=None)
    cli.add_argument("--resume", default=None)
    cli.add_argument("--max-steps", type=int, default=30)
    cli.add_argument("--save-steps", type=int, default=8)
    cli.add_argument("--limit", type=int, default=None)
    cli.add_argument("--slow", type=float, default=0.0)
    cli.add_argument("--progress", default=None)
    options = cli.parse_args()

    set_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, n_ctx=LENGTH
    )
    model = GPT2LMHeadModel(config)
    # The embeddings and the first block stay as initialised, as when fine-tuning the top of a
    # model: only part of the state changes between checkpoints.
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    model.transformer.h[0].requires_grad_(False)
    args = TrainingArguments(
        output_dir=options.output_dir,
        per_device_train_batch_size=4,
        max_steps=options.max_steps,
        save_strategy="steps",
        save_steps=options.save_steps,
        save_total_limit=options.limit,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1000,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    holder: list[Trainer] = []
    callbacks: list[TrainerCallback] = []
    if options.crash_after:
        callbacks.append(Crash(holder, options.crash_after))
    if options.progress:
        callbacks.append(Progress(options.progress, options.slow))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    holder.append(trainer)
    resume = {"true": True, None: None}.get(options.resume, options.resume)
    trainer.train(resume_from_checkpoint=resume)
    if options.out and trainer.is_world_process_zero():
        result = {
            "step": trainer.state.global_step,
            "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
        }
        torch.save(result, options.out)
    print("JOB DONE", flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # As the other multi-process jobs: every save committed (train() waited for them), so
        # end here, past gloo's teardown at interpreter exit, which can abort a process that
        # finished ("terminate called without an active exception") whatever the script did.
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
