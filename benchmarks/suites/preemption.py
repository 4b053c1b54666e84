"""Preemption: how long from SIGTERM to a committed checkpoint and to the exit, for the
benchmark's 209 MB training state (the 17.4 M-parameter transformer LM with AdamW), on local disk
and on an S3 endpoint on loopback (moto's server, as the tests use).

``python -m benchmarks.suites.preemption [--quick] [--out DIR]``: each target runs a real
Lightning job in its own process with ``IncrementalCheckpoint(every_n_train_steps=10)``, sends it
SIGTERM after step 15 (between two scheduled saves), and reads the job's own log for the moment
the signal arrived and the moment the last checkpoint committed; the exit is timed by this
process. Results go to ``DIR/preemption.{json,md}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SIGNAL_AFTER = 15


def _job(args: argparse.Namespace) -> None:
    import logging

    import lightning.pytorch as L
    import torch

    from benchmarks.harness.model import FULL, QUICK, RandomTokens, TinyLM
    from lightning_incremental import IncrementalCheckpoint

    logging.basicConfig(format="%(created).3f %(message)s", level=logging.INFO, force=True)
    torch.manual_seed(0)
    cfg = QUICK if args.quick else FULL

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyLM(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model.loss(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            tokens = RandomTokens.for_lm(cfg)
            data = [tokens()[0] for _ in range(40 * cfg.batch)]
            return torch.utils.data.DataLoader(data, batch_size=cfg.batch)

    class Progress(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            Path(args.out, "progress").write_text(str(trainer.global_step))

    options = json.loads(args.storage_options) if args.storage_options else None
    ckpt = IncrementalCheckpoint(args.dir, every_n_train_steps=10, storage_options=options)
    trainer = L.Trainer(
        max_steps=40,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, Progress()],
    )
    trainer.fit(LM())


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return proc, endpoint


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def _measure(name: str, url: str, options: dict[str, Any] | None, quick: bool) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"preempt-{name}-"))
    cmd = [sys.executable, "-m", "benchmarks.suites.preemption", "--job", "--dir", url]
    cmd += ["--out", str(out)]
    cmd += ["--storage-options", json.dumps(options)] if options else []
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = out / "job.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        signalled = None
        while proc.poll() is None:
            progress = out / "progress"
            step = int(progress.read_text() or 0) if progress.exists() else 0
            if signalled is None and step >= SIGNAL_AFTER:
                proc.send_signal(signal.SIGTERM)
                signalled = time.time()
            time.sleep(0.01)
        exited = time.time()
    text = log.read_text()
    requested = re.search(r"^(\d+\.\d+) preemption requested", text, re.M)
    committed = re.search(r"^(\d+\.\d+) IncrementalCheckpoint: preempted at step (\d+)", text, re.M)
    if signalled is None or requested is None or committed is None:
        raise RuntimeError(f"{name}: the job did not stop as expected:\n{text[-3000:]}")
    return {
        "target": name,
        "exit_code": proc.returncode,
        "stopped_at_step": int(committed.group(2)),
        "signal_to_request_s": round(float(requested.group(1)) - signalled, 3),
        "signal_to_committed_s": round(float(committed.group(1)) - signalled, 3),
        "signal_to_exit_s": round(exited - signalled, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--storage-options", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the ~6 MB model, for a smoke test")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.job:
        _job(args)
        return
    import s3fs  # the s3 extra

    work = Path(tempfile.mkdtemp(prefix="preempt-"))
    moto, endpoint = _moto()
    try:
        s3fs.S3FileSystem(**_s3_options(endpoint)).mkdir("preempt")
        rows = [
            _measure("local disk", str(work / "store"), None, args.quick),
            _measure(
                "S3 (moto on loopback)", "s3://preempt/run", _s3_options(endpoint), args.quick
            ),
        ]
    finally:
        moto.terminate()
    from benchmarks.harness.machine import describe

    result = {
        "state": "QUICK" if args.quick else "FULL (209 MB)",
        "rows": rows,
        "machine": describe(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "preemption_quick" if args.quick else "preemption"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Preemption: SIGTERM to a committed checkpoint and the exit",
        "",
        f"State: {result['state']}; a Lightning job, "
        f"`IncrementalCheckpoint(every_n_train_steps=10)`, SIGTERM after step {SIGNAL_AFTER}.",
        "",
        "| target | stopped at step | signal → committed | signal → exited | exit code |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['target']} | {row['stopped_at_step']} | {row['signal_to_committed_s']:.2f} s "
            f"| {row['signal_to_exit_s']:.2f} s | {row['exit_code']} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
