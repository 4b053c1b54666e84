"""Time to durable against ``torch.save``: ``python -m benchmarks.suites.durable``.

For each state size (a stack of square Linear layers trained with AdamW: weights plus both
moments, fp32), takes three states ``--interval`` training steps apart and times:

* ``torch.save`` of the third to a local file, then ``fsync`` (what a plain checkpoint costs to
  be durable);
* ``CheckpointStore.save(...).wait()`` of the second and of the third into a store that saved
  the first (snapshot, hash, delta-encode, write, fsync, commit) — the figures that matter for
  dense training. The second save's snapshot buffers are new memory; from the third on they are
  recycled, as in every later save of a run.

Each best and median of ``--repeats`` (a fresh store each time), on the same local disk. Writes
``benchmarks/results/durable.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.machine import parallel_scaling
from benchmarks.harness.timing import torch_save
from lightning_incremental.core import CheckpointStore

RESULTS = Path(__file__).parent.parent / "results"


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
    states = []
    for _ in range(3):
        train(model, opt, args.interval)
        states.append(_clone({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    first, second, third = states
    plain, ours, steady, written, steady_written, size, int8 = [], [], [], 0, 0, 0, 0
    efforts = []
    for i in range(args.repeats):
        path = root / f"plain-{i}.pt"
        plain.append(torch_save(third, path))
        size = path.stat().st_size
        path.unlink()
        with CheckpointStore(root / f"store-{i}", codec_effort=args.codec_effort) as store:
            store.save(first, step=1).wait()
            start = time.perf_counter()
            written = store.save(second, step=2).wait().bytes_written
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = store.save(third, step=3).wait()
            steady.append(time.perf_counter() - start)
            steady_written = result.bytes_written
            efforts.append(result.effort)
        shutil.rmtree(root / f"store-{i}")
    with CheckpointStore(root / "int8", optimizer_state="int8") as store:
        store.save(first, step=1).wait()
        store.save(second, step=2).wait()
        int8 = store.save(third, step=3).wait().bytes_written
    shutil.rmtree(root / "int8")
    del model, opt, states, first, second, third
    best, typical = min(plain), statistics.median(plain)
    return {
        "state_MB": size / 1e6,
        "torch_save_s": best,
        "torch_save_median_s": typical,
        "incremental_s": min(ours),
        "incremental_median_s": statistics.median(ours),
        "incremental_vs_torch_save": min(ours) / best,
        "steady_s": min(steady),
        "steady_median_s": statistics.median(steady),
        "steady_vs_torch_save": min(steady) / best,
        "steady_vs_torch_save_median": statistics.median(steady) / typical,
        "torch_save_MBps": size / best / 1e6,
        "incremental_MBps": size / min(ours) / 1e6,
        "steady_MBps": size / min(steady) / 1e6,
        "bytes_written": written,
        "fewer_bytes": size / written if written else None,
        "steady_bytes_written": steady_written,
        "steady_fewer_bytes": size / steady_written if steady_written else None,
        "int8_bytes_written": int8,
        "int8_fewer_bytes": size / int8 if int8 else None,
        "codec_effort": args.codec_effort,
        "steady_efforts": efforts,  # SaveResult.effort of each repeat's steady save
    }


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# Time to durable: a dense fp32 + AdamW state against torch.save",
        "",
        f"Three checkpoints {args.interval} training steps apart; `torch.save` + fsync of the "
        "third state, and a store that saves all three (fsync on, same local disk), from the call "
        "to the committed manifest: the *second* save (the first delta: its snapshot buffers are "
        "new memory, faulted in) and the *third* (steady state: buffers recycled, as in every "
        f"later save of a run). Best of {args.repeats}, median in brackets.",
        "",
    ]
    scaling = [r["parallel_scaling"] for r in rows if r.get("parallel_scaling")]
    if scaling:
        lines += [
            "Before each size, as many processes as CPUs, running the same loop, did "
            + ", ".join(f"{v:.2f}x" for v in scaling)
            + " one's work: a save is CPU-bound at the smallest size, and virtual CPUs on a "
            "shared host can deliver less than their number.",
            "",
        ]
    lines += [
        "| state | torch.save + fsync | ours, 2nd save | ours, steady | steady / torch.save | "
        "torch.save MB/s | ours MB/s, steady | bytes written: fewer than torch.save | "
        "with optimizer_state=int8 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['state_MB']:.0f} MB | {r['torch_save_s']:.3f} s ({r['torch_save_median_s']:.3f})"
            f" | {r['incremental_s']:.3f} s ({r['incremental_median_s']:.3f}) "
            f"| {r['steady_s']:.3f} s ({r['steady_median_s']:.3f}) "
            f"| {r['steady_vs_torch_save']:.2f}x ({r['steady_vs_torch_save_median']:.2f}x) "
            f"| {r['torch_save_MBps']:.0f} | {r['steady_MBps']:.0f} "
            f"| {r['steady_fewer_bytes']:.2f}x | {r['int8_fewer_bytes']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suites.durable", description=__doc__)
    p.add_argument("--sizes", default="100,400,900", help="state sizes in MB")
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (a local disk)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--codec-effort",
        choices=("auto", "full", "fast"),
        default="auto",
        help="the stores' codec_effort (auto: paced on a disk faster than the codec)",
    )
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="li-durable-") as tmp:
        for mb in (int(s) for s in args.sizes.split(",")):
            scaling = parallel_scaling()  # a save here is CPU-bound: what the CPUs gave
            rows.append({**measure(mb, args, Path(tmp)), "parallel_scaling": scaling})
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durable.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows, args)
    (args.out / "durable.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
