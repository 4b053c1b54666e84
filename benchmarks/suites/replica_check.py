"""What the replica check costs per checkpoint, against a training step and a ``torch.save``.

``python -m benchmarks.suites.replica_check [--quick] [--ranks 2]``: trains the ``dense_fp32``
workload (the 210 MB-state transformer; ``--quick``: the 6 MB one) for a few steps, then times,
best of ``--repeats``:

- one training step (forward, backward, AdamW step; one torch thread, as in the main benchmark);
- the check as the adapters run it: fingerprint the weights and optimizer state (one XXH3-128
  per tensor) and, with ``--ranks N`` > 1, gather the fingerprints over a real gloo group of N
  local processes and compare them;
- ``torch.save`` of the same state to local disk (the cost the check rides along with).

It prints a Markdown table and the ratios; ``--json`` writes them too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
from pathlib import Path

import torch

from benchmarks.harness.model import FULL, QUICK
from benchmarks.harness.scenarios import SCENARIOS, Params
from benchmarks.harness.timing import best_of
from lightning_incremental.runtime.state import replicas


def _measure(rank: int, world: int, port: int, quick: bool, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    work = SCENARIOS["dense_fp32"].build(Params(model=QUICK if quick else FULL))
    work.train(2)  # AdamW state exists
    state = {
        "model": work.model.state_dict(),
        "optimizers": [work.optimizer.state_dict()],
    }
    nbytes = sum(t.numel() * t.element_size() for _, t in replicas.leaves(state)
                 if isinstance(t, torch.Tensor))  # fmt: skip
    step_s = best_of(lambda: work.train(1), repeats)
    fingerprint_s = best_of(lambda: replicas.fingerprint(state), repeats)

    def check() -> None:
        if world > 1:
            torch.distributed.barrier()  # time the check, not the ranks' skew
        report = replicas.check_replicas(state)
        assert report.ok, report.describe()

    check_s = best_of(check, repeats)
    save_s = best_of(lambda: torch.save(state, io.BytesIO()), repeats)
    result = {
        "ranks": world,
        "state_bytes": nbytes,
        "tensors": sum(1 for _, t in replicas.leaves(state) if isinstance(t, torch.Tensor)),
        "train_step_s": step_s,
        "fingerprint_s": fingerprint_s,
        "check_s": check_s,
        "torch_save_s": save_s,
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 6 MB-state model")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes (1: no gather)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"replica_check_{os.getpid()}.json"
    if args.ranks > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(
            _measure,
            args=(args.ranks, port, args.quick, args.repeats, str(out)),
            nprocs=args.ranks,
        )
    else:
        _measure(0, 1, 0, args.quick, args.repeats, str(out))
    result = json.loads(out.read_text())
    out.unlink()
    mb = result["state_bytes"] / 1e6
    step, check, save = result["train_step_s"], result["check_s"], result["torch_save_s"]
    print(f"replica check, dense_fp32 state of {mb:.0f} MB ({result['tensors']} tensors), "
          f"{result['ranks']} gloo ranks, best of {args.repeats}:\n")  # fmt: skip
    print("| | seconds | vs training step | vs torch.save |")
    print("|---|---:|---:|---:|")
    for name, key in (
        ("training step", "train_step_s"),
        ("fingerprint only", "fingerprint_s"),
        ("check (fingerprint + gather + compare)", "check_s"),
        ("torch.save to memory", "torch_save_s"),
    ):
        value = result[key]
        print(f"| {name} | {value:.4f} | {value / step:.3f} | {value / save:.3f} |")
    print(f"\ncheck / training step = {check / step:.3f}; check / torch.save = {check / save:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
