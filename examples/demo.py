"""Demo: a Lightning job with incremental checkpoints survives a crash, bit-identically.

1. Fine-tunes a small transformer (embedding and lower blocks frozen, dropout, a shuffled
   DataLoader, AdamW) with ``Trainer(callbacks=[IncrementalCheckpoint(...)])``, checkpointing
   every 10 steps to a local directory.
2. The training process kills itself with SIGKILL mid-epoch (no clean-up, like a machine dying).
3. The same command is run again: it resumes by itself from the newest committed checkpoint —
   mid-epoch, random states and data position restored — and finishes.
4. An uninterrupted run of the same command runs for reference; the final weights must be
   bit-identical.
5. Prints the bytes written per checkpoint next to a full ``torch.save`` of the same checkpoint.

Usage: python examples/demo.py [--dir DIR] [--steps 60] [--every 10] [--crash-at 35]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB, DIM, LAYERS, SEQ, BATCH, SAMPLES = 4000, 256, 4, 64, 8, 200  # 25 steps an epoch


def build_model() -> Any:
    import lightning.pytorch as L

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [
                nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True)
                for _ in range(LAYERS)
            ]
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.Sequential(*layers)
            self.head = nn.Linear(DIM, VOCAB)
            # Fine-tuning: the embedding and the lower half of the blocks stay frozen.
            for module in (self.embed, *layers[: LAYERS // 2]):
                module.requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self.head(self.blocks(self.embed(tokens[:, :-1])))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-4)

        def train_dataloader(self) -> Any:
            from torch.utils.data import DataLoader, TensorDataset

            g = torch.Generator().manual_seed(1000)
            tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
            # Shuffled with a seeded generator: a resumed epoch continues in the same order.
            return DataLoader(
                TensorDataset(tokens), batch_size=BATCH, shuffle=True, generator=torch.Generator()
            )

    return TinyLM()


def train(args: argparse.Namespace) -> None:
    import lightning.pytorch as L

    from lightning_incremental import IncrementalCheckpoint

    class Figures(L.Callback):
        """Appends each committed save's figures to figures.jsonl; crashes on request."""

        def __init__(self, checkpoint: IncrementalCheckpoint) -> None:
            self.checkpoint, self.written = checkpoint, 0

        def flush(self) -> None:
            with open(Path(args.dir) / "figures.jsonl", "a") as log:
                for result, blocked in self.checkpoint.results[self.written :]:
                    log.write(
                        json.dumps(
                            {
                                "step": result.step,
                                "blocked_ms": blocked * 1e3,
                                "save_ms": result.total_s * 1e3,
                            }
                        )
                        + "\n"
                    )
                    self.written += 1

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            if trainer.global_step == args.crash_at:
                self.checkpoint.wait()
                self.flush()
                print(f"[train] step {args.crash_at}: simulating a crash (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            self.flush()

        def on_train_end(self, trainer: L.Trainer, *rest: Any) -> None:
            self.checkpoint.wait()
            self.flush()

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    checkpoint = IncrementalCheckpoint(Path(args.dir) / "store", every_n_train_steps=args.every)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[checkpoint, Figures(checkpoint)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = build_model()
    trainer.fit(model)  # resumes by itself when the store holds a checkpoint
    if checkpoint.resumed_from is not None:
        print(f"[train] resumed from step {checkpoint.resumed_from}", flush=True)
    torch.save(model.state_dict(), Path(args.dir) / "final.pt")


def run(dirpath: Path, args: argparse.Namespace, crash_at: int) -> int:
    command = [
        sys.executable,
        __file__,
        "--train",
        "--dir",
        str(dirpath),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--crash-at",
        str(crash_at),
    ]
    return subprocess.run(command, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="demo_run")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=35)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args)
        return

    from rich.console import Console
    from rich.table import Table

    from lightning_incremental.core import CheckpointStore

    console = Console(width=max(110, shutil.get_terminal_size().columns))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    interrupted, reference = root / "interrupted", root / "reference"
    for d in (interrupted, reference):
        d.mkdir(parents=True)
    started = time.perf_counter()
    console.rule("run 1: training, crashes mid-epoch")
    code = run(interrupted, args, args.crash_at)
    console.print(
        f"training process ended with {code} "
        f"({'killed by SIGKILL' if code == -signal.SIGKILL else 'unexpected'})"
    )
    console.rule("run 2: the same command again — resumes by itself")
    if run(interrupted, args, crash_at=-1) != 0:
        sys.exit("the resumed run failed")
    console.rule("reference: the same training without a crash")
    if run(reference, args, crash_at=-1) != 0:
        sys.exit("the reference run failed")

    figures = {}
    for line in (interrupted / "figures.jsonl").read_text().splitlines():
        figures[json.loads(line)["step"]] = json.loads(line)
    table = Table(
        title="Bytes written per checkpoint (a full Lightning checkpoint each time: "
        "fine-tuning, frozen embedding and lower blocks)"
    )
    for name in (
        "step",
        "checkpoint MB",
        "torch.save MB",
        "written MB",
        "fewer bytes",
        "blocked ms",
        "chunks reused/delta/full",
    ):
        table.add_column(name, justify="right")
    total_ours = total_plain = 0
    with CheckpointStore(str(interrupted / "store")) as store:
        for step in store.steps():
            stats = store.manifest(step).stats
            plain = io.BytesIO()
            torch.save(store.load(step), plain)
            total_ours += stats["bytes_data"]
            total_plain += plain.tell()
            blocked = figures.get(step, {}).get("blocked_ms")
            table.add_row(
                str(step),
                f"{stats['bytes_logical'] / 1e6:.1f}",
                f"{plain.tell() / 1e6:.1f}",
                f"{stats['bytes_data'] / 1e6:.2f}",
                f"{plain.tell() / stats['bytes_data']:.1f}x",
                f"{blocked:.1f}" if blocked is not None else "-",
                f"{stats['chunks_reused']} / {stats['chunks_delta']} / {stats['chunks_full']}",
            )
    table.add_row(
        "total",
        "",
        f"{total_plain / 1e6:.1f}",
        f"{total_ours / 1e6:.2f}",
        f"{total_plain / total_ours:.1f}x",
        "",
        "",
        end_section=True,
    )
    console.print(table)

    final_a = torch.load(interrupted / "final.pt", weights_only=True)
    final_b = torch.load(reference / "final.pt", weights_only=True)
    identical = final_a.keys() == final_b.keys() and all(
        torch.equal(
            final_a[k].reshape(-1).view(torch.uint8), final_b[k].reshape(-1).view(torch.uint8)
        )
        for k in final_b
    )
    console.print(
        f"final weights of the crashed-and-resumed run vs the uninterrupted run: "
        f"{'[bold green]bit-identical[/]' if identical else '[bold red]DIFFERENT[/]'}"
    )
    console.print(f"demo finished in {time.perf_counter() - started:.0f}s; stores in {root}/")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
