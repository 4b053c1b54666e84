"""The randomized crash matrix (``tests/jobs/resume_matrix.py``): runs that die anywhere — or finish
and are extended — resume bit-identically.

Each case is a real crash: the training process ends itself with ``os._exit`` in
``on_train_batch_end`` (no teardown, no exception handler, no save at the end), sometimes with the
newest save still in flight; the same command then runs again and resumes by itself. One driver
process runs all of a test's cases (forking a child per run), so the matrix costs seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.conftest import DEEP
from tests.jobs.resume_matrix import Case, cases

DRIVER = Path(__file__).resolve().parents[1] / "jobs" / "resume_matrix.py"
REPO = Path(__file__).resolve().parents[2]

# The configurations first seen to resume wrong: checkpoints taken at an epoch's end of an
# iteration-based run (160 samples, batch 16: 10 batches per epoch, max_steps=40), a
# ReduceLROnPlateau stepped after the epoch-end checkpoint, and runs extended past max_steps.
KNOWN = [
    Case(160, 16, "shuffle_global", "epochs", 1, "max_steps", 40, "off", 1, "epoch", 21, True),
    Case(160, 16, "shuffle_global", "epochs", 1, "max_steps", 40, "off", 1, "epoch", 29, False),
    Case(160, 16, "shuffle_generator", "steps", 10, "max_steps", 40, "off", 1, "epoch", 23, True),
    Case(160, 16, "sequential", "steps", 20, "max_steps", 40, "off", 1, "none", 29, True),
    Case(160, 16, "shuffle_global", "steps", 2, "max_steps", 40, "off", 1, "epoch", 21, True),
    Case(160, 16, "shuffle_global", "steps", 5, "max_steps", 40, "off", 1, "epoch", 21, True),
    Case(40, 8, "distributed", "epochs", 1, "max_steps", 13, "off", 1, "epoch", 12, True),
    Case(
        40,
        8,
        "shuffle_generator",
        "epochs",
        1,
        "max_steps",
        20,
        "off",
        1,
        "plateau_train",
        14,
        True,
    ),
    Case(28, 4, "shuffle_generator", "steps", 1, "max_steps", 28, 3, 1, "plateau_val", 11, True),
    Case(56, 8, "sequential", "steps", 5, "max_steps", 14, 7, 1, "plateau_train", 8, True),
    Case(
        24,
        8,
        "shuffle_generator",
        "epochs",
        1,
        "max_steps",
        12,
        1,
        1,
        "plateau_train",
        None,
        False,
        first_total=8,
    ),
    Case(
        40,
        8,
        "shuffle_global",
        "epochs",
        1,
        "max_steps",
        6,
        0.5,
        3,
        "none",
        None,
        False,
        first_total=2,
    ),
]


def run_matrix(chosen: list[Case], tmp_path: Path) -> list[dict]:
    payload = json.dumps([asdict(c) for c in chosen])
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--dir", str(tmp_path), "--cases", payload],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(chosen), done.stderr[-4000:]
    return results


def assert_all_exact(results: list[dict]) -> None:
    failed = [
        f"{r.get('label') or r['case']}: {r.get('error') or r.get('first_divergence')} "
        f"(differ: {r.get('differ')})"
        for r in results
        if not r["ok"]
    ]
    assert not failed, f"{len(failed)} of {len(results)} cases not exact:\n" + "\n".join(failed)


def test_draws_cover_every_dimension() -> None:
    drawn = cases(0, 150)
    assert {c.sampler for c in drawn} == {
        "shuffle_generator",
        "shuffle_global",
        "sequential",
        "distributed",
    }
    assert {c.scheduler for c in drawn} == {"none", "step", "epoch", "plateau_val", "plateau_train"}
    assert {c.cadence for c in drawn} == {"steps", "epochs", "time"}
    assert {c.limit for c in drawn} == {"max_steps", "max_epochs"}
    assert {c.accumulate for c in drawn} >= {1, 2, 3}
    assert {type(c.val_check) for c in drawn} >= {type(None), str, int, float}
    assert any(c.crash_at is None for c in drawn) and any(c.wait for c in drawn)
    assert any(not c.wait and c.crash_at is not None for c in drawn)
    assert cases(0, 150) == drawn  # seeded: the same cases every run


def test_known_configurations_resume_bit_identical(tmp_path: Path) -> None:
    assert_all_exact(run_matrix(KNOWN, tmp_path))


def test_quick_slice_of_the_matrix(tmp_path: Path) -> None:
    assert_all_exact(run_matrix(cases(0, 16), tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5] if DEEP else [1, 2])
def test_randomized_crash_matrix(seed: int, tmp_path: Path) -> None:
    assert_all_exact(run_matrix(cases(seed, 60), tmp_path))
