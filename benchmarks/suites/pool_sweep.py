"""A sweep of 4 LoRA fine-tunes of one frozen base, stored four ways, side by side.

Each run is its own process, started one after the other (as a sweep's jobs are): it builds
the benchmark's :class:`~benchmarks.harness.model.TinyLM` from the same seed (the shared base),
adds LoRA adapters (:mod:`benchmarks.harness.lora`) with a seed of its own, trains them with
AdamW at its own learning rate and checkpoints ``{"model", "optimizer"}`` every step. The
checkpoints go to:

- ``torch``: ``torch.save`` files;
- ``separate``: one ``CheckpointStore`` per run;
- ``pool``: one store per run, all in one shared object pool;
- ``fork``: a base store holding the adapted model before training, and per run a fork of it
  (``CheckpointStore.fork``) in one pool.

Reported: the bytes each layout holds, against one ``torch.save`` of the base's weights.

    python -m benchmarks.suites.pool_sweep [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.lora import add_lora
from benchmarks.harness.model import FULL, QUICK, ModelConfig, RandomTokens, TinyLM, train_step
from lightning_incremental.core import CheckpointStore

MODES = ("torch", "separate", "pool", "fork")
RUNS = 4
STEPS = 3


def _model(cfg: ModelConfig, adapter_seed: int) -> TinyLM:
    torch.manual_seed(0)  # the shared base
    model = TinyLM(cfg)
    torch.manual_seed(1000 + adapter_seed)
    add_lora(model)
    return model


def _state(model: TinyLM, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
    return out


def child(mode: str, run: int, root: Path, cfg: ModelConfig, steps: int = STEPS) -> None:
    """One run of the sweep (a process of its own)."""
    model = _model(cfg, run)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3 * (run + 1))
    batches = RandomTokens.for_lm(cfg, seed=run)
    store: CheckpointStore | None = None
    if mode == "separate":
        store = CheckpointStore(root / f"run{run}")
    elif mode == "pool":
        store = CheckpointStore(root / f"run{run}", pool=root / "objects")
    elif mode == "fork":
        CheckpointStore.fork(str(root / "base"), str(root / f"run{run}"), pool=root / "objects")
        store = CheckpointStore(root / f"run{run}")
        store.load(keys="model")  # the base checkpoint: the first save's delta base
    for step in range(1, steps + 1):
        train_step(model, optimizer, batches())
        state = _state(model, optimizer)
        if store is None:
            (root / f"run{run}").mkdir(parents=True, exist_ok=True)
            torch.save(state, root / f"run{run}" / f"step{step}.pt")
        else:
            store.save(state, step + (1 if mode == "fork" else 0)).wait()
    if store is not None:
        store.close()


def base_store(root: Path, cfg: ModelConfig) -> None:
    with CheckpointStore(root / "base") as store:
        store.save(_state(_model(cfg, -1), None), 1).wait()


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.pool_sweep")
    parser.add_argument("--quick", action="store_true", help="the small model (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="write pool_sweep.json/.md here")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "RUN", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.child:
        mode, run, root = args.child
        child(mode, int(run), Path(root), cfg)
        return {}
    base_model = _model(cfg, 0)
    frozen = {k: v for k, v in base_model.state_dict().items() if not k.endswith((".A", ".B"))}
    with tempfile.TemporaryDirectory() as tmp:
        base_file = Path(tmp) / "base.pt"
        torch.save(frozen, base_file)
        base_bytes = base_file.stat().st_size
        results: dict[str, Any] = {"config": cfg.as_dict(), "runs": RUNS, "checkpoints": STEPS}
        results["base_torch_save_bytes"] = base_bytes
        for mode in MODES:
            root = Path(tmp) / mode
            root.mkdir()
            if mode == "fork":
                base_store(root, cfg)
            started = time.perf_counter()
            for run in range(RUNS):  # one process after the other
                command = [sys.executable, "-m", "benchmarks.suites.pool_sweep", "--child", mode]
                command += [str(run), str(root)] + (["--quick"] if args.quick else [])
                subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
            stored = _bytes(root)
            results[mode] = {
                "bytes": stored,
                "x_base": round(stored / base_bytes, 3),
                "seconds": round(time.perf_counter() - started, 1),
            }
    table = [
        f"4 LoRA fine-tunes of one base ({sum(v.numel() for v in frozen.values()):,} frozen "
        f"parameters, one torch.save of them: {base_bytes / 1e6:.1f} MB), {STEPS} checkpoints "
        "each (model and optimizer), each run a process started after the previous one:",
        "",
        "| layout | stored MB | x one base |",
        "|---|---|---|",
    ]
    names = {
        "torch": "torch.save per checkpoint",
        "separate": "4 separate stores",
        "pool": "4 stores in one pool",
        "fork": "4 forks of a base store, in one pool (base included)",
    }
    for mode in MODES:
        r = results[mode]
        table.append(f"| {names[mode]} | {r['bytes'] / 1e6:.1f} | {r['x_base']} |")
    text = "\n".join(table)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pool_sweep.json").write_text(json.dumps(results, indent=1))
        (args.out / "pool_sweep.md").write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
