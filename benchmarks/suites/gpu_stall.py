"""The training stall of one checkpoint on a GPU: how long the training loop is blocked by a save
of the benchmark LM's state (weights and AdamW moments on the device), for ``torch.save`` (device
to host and the write, synchronous), DCP ``async_save`` (blocked for its staging copy) and the
incremental store (blocked while the copies are queued on the side stream; see
``lightning_incremental/core/save/snapshot.py``), with a real training step between saves.

``python -m benchmarks.suites.gpu_stall [--quick] [--saves N] [--out DIR]`` writes
``DIR/gpu_stall.{json,md}``. Needs a CUDA device; ``scripts/device-check.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.model import FULL, QUICK, RandomTokens, TinyLM, train_step
from benchmarks.harness.state import tensor_bytes


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def measure(quick: bool, saves: int, work: Path) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    torch.manual_seed(0)
    model = TinyLM(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = RandomTokens.for_lm(cfg)

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optimizer, data().cuda())
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    state_bytes = tensor_bytes(_state(model, optimizer))
    figures: dict[str, Any] = {"state_mb": state_bytes / 1e6, "step_s": step()}

    def run(name: str, save: Any, finish: Any = None) -> None:
        stalls = []
        for i in range(saves):
            step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            save(i)
            stalls.append(time.perf_counter() - start)
        if finish is not None:
            finish()
        figures[name] = {"stall_s": statistics.median(stalls), "stalls": stalls}

    run("torch_save", lambda i: torch.save(_state(model, optimizer), work / f"t{i}.pt"))

    from lightning_incremental.core import CheckpointStore

    with CheckpointStore(str(work / "store")) as store:
        run("incremental", lambda i: store.save(_state(model, optimizer), i + 1), store.wait)

    import torch.distributed.checkpoint as dcp

    futures: list[Any] = []

    def dcp_save(i: int) -> None:
        if futures:
            futures[-1].result()
        futures.append(
            dcp.async_save(
                _state(model, optimizer), storage_writer=dcp.FileSystemWriter(work / f"d{i}")
            )
        )

    try:
        run("dcp_async", dcp_save, lambda: futures[-1].result())
    except Exception as exc:  # DCP without a process group differs across torch versions
        figures["dcp_async"] = {"error": f"{type(exc).__name__}: {exc}"}
    return figures


def main(argv: list[str] | None = None) -> None:
    prog = "python -m benchmarks.suites.gpu_stall"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.suites.gpu_stall needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-stall-") as work:
        figures = measure(args.quick, args.saves, Path(work))
    figures["device"] = torch.cuda.get_device_name()
    figures["torch"] = torch.__version__
    (out / "gpu_stall.json").write_text(json.dumps(figures, indent=1))
    lines = [
        f"# Training stall per checkpoint on {figures['device']} (torch {figures['torch']})",
        "",
        f"State {figures['state_mb']:.1f} MB; a training step {figures['step_s'] * 1e3:.1f} ms.",
        "",
        "| system | stall per save (median) | x torch.save |",
        "|---|---|---|",
    ]
    base = figures["torch_save"]["stall_s"]
    for name in ("torch_save", "dcp_async", "incremental"):
        row = figures[name]
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | - |")
        else:
            ms, ratio = row["stall_s"] * 1e3, row["stall_s"] / base
            lines.append(f"| {name} | {ms:.1f} ms | {ratio:.2f} |")
    (out / "gpu_stall.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
