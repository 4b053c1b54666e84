"""CPU time of one memory step, on the training thread and in all: a figure that a shared
machine's load disturbs far less than wall-clock time.

``python -m benchmarks.suites.memory_tier_step [--before DIR] [--rounds N] [--out DIR]``. Each round
runs, in a fresh process per checkout (this one, and ``--before``'s), the memory tier's
``take`` of the benchmark LM's checkpoint (FULL: 17.4 M parameters with AdamW, ~209 MB) for 15
steps on one torch thread, and records per step from the 4th on: the training thread's CPU time
of ``take`` (``time.thread_time``: the snapshot) and the process's CPU time from ``take`` until
the step's background work is done (``time.process_time``: snapshot, hash, writes, deletes).
Medians per process; the report gives the lowest median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_JOB = """
import json, shutil, tempfile, time
from pathlib import Path
import torch
try:
    from benchmarks.harness.model import FULL, TinyLM
except ModuleNotFoundError:  # a checkout from before benchmarks/harness/
    from benchmarks.model import FULL, TinyLM
try:
    from lightning_incremental.runtime.memory.steps import MemoryOptions, MemorySteps
except ModuleNotFoundError:  # a checkout from before runtime/memory/
    from lightning_incremental.runtime.memory_steps import MemoryOptions, MemorySteps
torch.set_num_threads(1)
torch.manual_seed(0)
model = TinyLM(FULL)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step()
d = Path(tempfile.mkdtemp(prefix="li-bench-step-", dir="/dev/shm"))
steps = MemorySteps(MemoryOptions(1, 1, str(d)), rank=0, world_size=1, ranks_per_node=1,
    url=str(d / "s"), generation=None, allow_pickle=False, owner="bench",
    info=lambda t: None, warn=print)
take, total = [], []
try:
    for step in range(1, 16):
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        p0, t0 = time.process_time(), time.thread_time()
        steps.take(step, state)
        t1 = time.thread_time()
        steps.wait()
        if step > 3:
            take.append(t1 - t0)
            total.append(time.process_time() - p0)
    size = sum(f.stat().st_size for f in d.rglob("data.bin"))
finally:
    steps.finish()
    steps.close()
    shutil.rmtree(d, ignore_errors=True)
take.sort()
total.sort()
print(json.dumps({"take_cpu_s": take[len(take) // 2], "step_cpu_s": total[len(total) // 2],
                  "part_bytes": size}))
"""


def run(root: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", _JOB], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.memory_tier_step")
    parser.add_argument("--before", help="another checkout of the project to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    roots = {"after": ROOT} | ({"before": Path(args.before)} if args.before else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name, root in roots.items():
            runs[name].append(run(root))
    from benchmarks.harness.machine import describe

    best = {
        name: {key: min(r[key] for r in rs) for key in ("take_cpu_s", "step_cpu_s")}
        for name, rs in runs.items()
    }
    doc = {"machine": describe(), "loadavg": os.getloadavg(), "best": best, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_tier_step.json").write_text(json.dumps(doc, indent=1))
    lines = [
        "| checkout | training thread, ms a step | process in all, ms a step |",
        "| --- | ---: | ---: |",
    ]
    for name, b in best.items():
        lines.append(f"| {name} | {b['take_cpu_s'] * 1e3:.1f} | {b['step_cpu_s'] * 1e3:.1f} |")
    text = "\n".join(lines) + "\n"
    (out / "memory_tier_step.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
