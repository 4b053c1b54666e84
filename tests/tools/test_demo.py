"""The README's demo, shortened: a real SIGKILL mid-run, a resume, bit-identical final weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_crash_resume_is_bit_identical(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "demo.py"),
            "--dir",
            str(tmp_path / "run"),
            "--steps",
            "20",
            "--every",
            "5",
            "--crash-at",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from step 10" in out.stdout
    assert "killed by SIGKILL" in out.stdout
    assert "bit-identical" in out.stdout
    manifests = tmp_path / "run" / "interrupted" / "store" / "manifests"
    steps = sorted(p.name for p in manifests.iterdir())
    assert [int(s.split(".")[0]) for s in steps] == [5, 10, 15, 20]
