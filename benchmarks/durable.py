"""Time to durable against ``torch.save``: ``python -m benchmarks.durable``.

For each state size (a stack of square Linear layers trained with AdamW: weights plus both
moments, fp32), trains ``--interval`` steps between two checkpoints and times, on the second:

* ``torch.save`` to a local file, then ``fsync`` (what a plain checkpoint costs to be durable);
* ``CheckpointStore.save(...).wait()`` of the second checkpoint into a store that saved the
  first (snapshot, hash, delta-encode, write, fsync, commit) — the figure that matters for
  dense training.

Each best of ``--repeats`` (a fresh store each time), on the same local disk. Writes
``benchmarks/results/durable.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_incremental.core import CheckpointStore

RESULTS = Path(__file__).parent / "results"


def build(megabytes: int, width: int = 1024) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A Linear stack whose weights plus AdamW moments take about ``megabytes`` MB."""
    per_layer = 3 * 4 * (width * width + width)
    layers = max(1, round(megabytes * 1e6 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, model[0].in_features)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()


def torch_save(state: Any, path: Path) -> float:
    start = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def measure(megabytes: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model, opt = build(megabytes)
    train(model, opt, args.interval)
    first = _clone({"model": model.state_dict(), "optimizer": opt.state_dict()})
    train(model, opt, args.interval)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    plain, ours, written, size, int8 = [], [], 0, 0, 0
    for i in range(args.repeats):
        path = root / f"plain-{i}.pt"
        plain.append(torch_save(state, path))
        size = path.stat().st_size
        path.unlink()
        with CheckpointStore(root / f"store-{i}") as store:
            store.save(first, step=1).wait()
            start = time.perf_counter()
            result = store.save(state, step=2).wait()
            ours.append(time.perf_counter() - start)
            written = result.bytes_written
        shutil.rmtree(root / f"store-{i}")
    with CheckpointStore(root / "int8", optimizer_state="int8") as store:
        store.save(first, step=1).wait()
        int8 = store.save(state, step=2).wait().bytes_written
    shutil.rmtree(root / "int8")
    del model, opt, state, first
    return {
        "state_MB": size / 1e6,
        "torch_save_s": min(plain),
        "incremental_s": min(ours),
        "incremental_vs_torch_save": min(ours) / min(plain),
        "torch_save_MBps": size / min(plain) / 1e6,
        "incremental_MBps": size / min(ours) / 1e6,
        "bytes_written": written,
        "fewer_bytes": size / written if written else None,
        "int8_bytes_written": int8,
        "int8_fewer_bytes": size / int8 if int8 else None,
    }


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# Time to durable: second checkpoint of a dense fp32 + AdamW state",
        "",
        f"{args.interval} training steps between the checkpoints; best of {args.repeats}; "
        "both fsynced on the same local disk. Ours: the second save of a store that holds the "
        "first checkpoint (its delta bases in memory), from the call to the committed manifest.",
        "",
        "| state | torch.save + fsync | ours, to durable | ours / torch.save | "
        "torch.save MB/s | ours MB/s | bytes written: fewer than torch.save | "
        "with optimizer_state=int8 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['state_MB']:.0f} MB | {r['torch_save_s']:.2f} s | {r['incremental_s']:.2f} s "
            f"| {r['incremental_vs_torch_save']:.2f}x | {r['torch_save_MBps']:.0f} | "
            f"{r['incremental_MBps']:.0f} | {r['fewer_bytes']:.2f}x | "
            f"{r['int8_fewer_bytes']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.durable", description=__doc__)
    p.add_argument("--sizes", default="100,400,900", help="state sizes in MB")
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (a local disk)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="li-durable-") as tmp:
        for mb in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(mb, args, Path(tmp)))
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durable.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows, args)
    (args.out / "durable.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
