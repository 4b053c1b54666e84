"""A figure of the scale benchmark: its record (ours, the baseline, the ratio) and its target."""

from __future__ import annotations

from typing import Any

# Targets: ratios to the baseline, except where ``absolute`` (a value in the figure's unit).
STALL_TARGET = 0.1
DURABLE_TARGET = 1.0
RESTORE_TARGET = 1.2
MANIFEST_TARGET_B = 64.0
COPY_STALL_TARGET = 1.5  # the steady big-state stall, to a copy into existing buffers
PEAK_MEMORY_TARGET_X = 2.1  # peak extra host memory of a save, a multiple of the state


def record(
    sweep: str,
    case: str,
    size: float,
    figure: str,
    ours: float,
    baseline: float | None,
    baseline_name: str | None,
    unit: str,
    target: float | None = None,
    absolute: bool = False,
    detail: str | None = None,
) -> dict[str, Any]:
    """One row: ``ratio`` is ours / baseline; ``met`` compares the ratio (or, ``absolute``, our
    value) with ``target`` (None: no target); ``detail``: what the figure depends on, printed
    as a note under the table."""
    # a multiple of the state beside a baseline near zero is no ratio
    ratio = ours / baseline if baseline and unit != "x" else None
    checked = ours if absolute else ratio
    met = None if target is None or checked is None else bool(checked <= target)
    return {
        "sweep": sweep,
        "case": case,
        "size": size,
        "figure": figure,
        "ours": ours,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "target_absolute": absolute,
        "met": met,
        "detail": detail,
    }
