"""From a failure to training again: the memory tier every step against the store alone.

``python -m benchmarks.suites.recovery [--out DIR]``

Two torchrun agents as two nodes on this machine (one training process each, each node with its
own memory directory), running the Lightning DDP job of ``tests/jobs/memory_job.py`` (a tiny
model, the store every 10 steps), twice: with the memory tier every step and with the store
alone. Each run meets the same three failures, as a cluster does:

- **process**: one node's training process SIGKILLed at step 25 (its agent restarts the group);
- **node**: at step 29 the other node lost whole (agent and process SIGKILLed, its memory with
  it) and a replacement agent with an empty memory directory started;
- **both**: at step 31 both nodes' memory emptied and a process killed.

For each failure: the step the group resumed from, the steps it lost (the step reached less the
step resumed from), the tier that gave it, and the seconds from the kill to training again
(the restarted processes' ``on_train_start``; most of it is torchrun's restart, the rendezvous
and the imports, the same with either). Writes ``recovery.{json,md}`` under ``--out`` (default
``bench_out``; the committed results come from ``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

from tests.jobs import two_nodes

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_job.py"
KILLS = ("1:25", "@memory1:29:node", "0:31:all")
FAILURES = ("process", "node", "both")
TIMEOUT_S = 600


def run(memory_every: int, scratch: Path) -> list[dict[str, Any]]:
    """One job with the three failures; a record per failure."""
    tmp = scratch / f"memory_every_{memory_every}"
    tmp.mkdir()
    args = ["--no-reference", "--memory-every", str(memory_every), *two_nodes.kill_args(KILLS)]
    rcs, logs = two_nodes.run(tmp, JOB, args, TIMEOUT_S)
    if rcs != [0, -signal.SIGKILL, 0]:
        raise RuntimeError(f"the job did not end as planned:\n{logs[-6000:]}")
    events_file = tmp / "out" / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill"]
    starts = [e for e in events if e["event"] == "started"]
    rows = []
    for name, kill in zip(FAILURES, kills, strict=True):
        back = min((e for e in starts if e["time"] > kill["time"]), key=lambda e: e["time"])
        rows.append(
            {
                "failure": name,
                "memory_every": memory_every,
                "killed_at": kill["step"],
                "resumed_from": back["resumed_from"],
                "steps_lost": kill["step"] - back["resumed_from"],
                "tier": back["resumed_tier"] or "store",
                "seconds_to_training": back["time"] - kill["time"],
            }
        )
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| failure | tier | killed at | resumed from | steps lost | training again after |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        which = "memory every step + store every 10" if r["memory_every"] else "store every 10"
        lines.append(
            f"| {r['failure']} ({which}) | {r['tier']} | {r['killed_at']} | "
            f"{r['resumed_from']} | {r['steps_lost']} | {r['seconds_to_training']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.recovery")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="li-bench-recovery-") as scratch:
        for memory_every in (1, 0):
            rows += run(memory_every, Path(scratch))
    from benchmarks.harness.machine import describe

    doc = {"machine": describe(), "loadavg": os.getloadavg(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(doc, indent=1))
    text = report(rows)
    (out / "recovery.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
