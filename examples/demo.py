"""Demo: incremental checkpoints survive a crash, and the resumed run is bit-identical.

1. Trains a small transformer (fine-tuning: embeddings and the lower blocks frozen) with AdamW,
   checkpointing every 10 steps through ``lightning_incremental.core.CheckpointStore`` to a
   local directory.
2. The training process kills itself with SIGKILL mid-run (no clean-up, like a machine dying).
3. The same command is run again: it resumes from the newest committed checkpoint and finishes.
4. An uninterrupted run of the same command runs for reference; the final weights must be
   bit-identical.
5. Prints bytes written per checkpoint against a full ``torch.save`` of the same state.

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

import torch
from torch import nn

VOCAB, DIM, LAYERS, SEQ, BATCH = 4000, 256, 4, 64, 8


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True)
        for _ in range(LAYERS)
    ]
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(VOCAB, DIM))
    model.add_module("blocks", nn.Sequential(*layers))
    model.add_module("head", nn.Linear(DIM, VOCAB))
    # Fine-tuning: the embedding and the lower half of the blocks stay frozen.
    for module in (model.embed, *layers[: LAYERS // 2]):
        module.requires_grad_(False)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``step`` depends only on the step, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(args: argparse.Namespace) -> None:
    from lightning_incremental.core import CheckpointStore

    torch.set_num_threads(1)
    model = build_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-4)
    store = CheckpointStore(args.dir)
    step = 0
    if store.steps():
        state = store.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
        print(f"[train] resumed from step {step} in {args.dir}", flush=True)
    log = open(Path(args.dir) / "figures.jsonl", "a")  # noqa: SIM115 - closed at the end
    while step < args.steps:
        inputs, targets = batch(step)
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step == args.crash_at:
            print(f"[train] step {step}: simulating a crash (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.every == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step,
            }
            result = store.save(state, step, metadata={"loss": loss.item()}).wait()
            plain = io.BytesIO()
            torch.save(state, plain)
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "logical": result.bytes_logical,
                        "written": result.bytes_written,
                        "torch_save": plain.tell(),
                        "blocked_ms": result.snapshot_s * 1e3,
                        "save_ms": result.total_s * 1e3,
                        "reused": result.chunks_reused,
                        "delta": result.chunks_delta,
                        "full": result.chunks_full,
                    }
                )
                + "\n"
            )
            log.flush()
            print(
                f"[train] step {step}: loss {loss.item():.4f}, checkpoint committed "
                f"({result.bytes_written / 1e6:.2f} MB written)",
                flush=True,
            )
    store.close()
    log.close()
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

    console = Console(width=max(110, shutil.get_terminal_size().columns))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    interrupted, reference = root / "interrupted", root / "reference"
    for d in (interrupted, reference):
        d.mkdir(parents=True)
    started = time.perf_counter()
    console.rule("run 1: training, crashes mid-run")
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

    rows = [json.loads(line) for line in (interrupted / "figures.jsonl").read_text().splitlines()]
    table = Table(
        title="Bytes written per checkpoint (fine-tuning, frozen embedding + lower blocks)"
    )
    for name in (
        "step",
        "state MB",
        "torch.save MB",
        "written MB",
        "fewer bytes",
        "blocked ms",
        "chunks reused/delta/full",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            str(r["step"]),
            f"{r['logical'] / 1e6:.1f}",
            f"{r['torch_save'] / 1e6:.1f}",
            f"{r['written'] / 1e6:.2f}",
            f"{r['torch_save'] / r['written']:.1f}x",
            f"{r['blocked_ms']:.1f}",
            f"{r['reused']} / {r['delta']} / {r['full']}",
        )
    total_ours = sum(r["written"] for r in rows)
    total_plain = sum(r["torch_save"] for r in rows)
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
    identical = all(
        torch.equal(final_a[k].view(-1).view(torch.uint8), final_b[k].view(-1).view(torch.uint8))
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
