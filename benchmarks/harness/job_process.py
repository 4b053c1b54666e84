"""One benchmark job in a fresh process: ``python -m MODULE --job JSON``, its record back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_job(module: str, job: dict[str, Any], root: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``module``'s job ``job`` from the checkout ``root`` (first on the path); the record
    it wrote to ``job["result"]``, or ``job`` with an ``error`` (its exit code and output's
    tail, or the timeout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run(
            [sys.executable, "-m", module, "--job", json.dumps(job)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {**job, "error": f"timed out after {timeout_s} s"}
    result = Path(job["result"])
    if out.returncode == 0 and result.exists():
        record: dict[str, Any] = json.loads(result.read_text())
        return record
    return {**job, "error": f"exit code {out.returncode}: {(out.stdout + out.stderr)[-3000:]}"}
