"""The per tensor kind codec breakdown (:mod:`benchmarks.harness.analysis`) as Markdown: the
section ``python -m benchmarks --analyze`` adds to its report."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.analysis import PASSES, THREADS
from lightning_incremental.core.chunks.hints import HINT_TTL


def markdown(per_scenario: dict[str, dict[str, Any]]) -> str:
    """One row per scenario and tensor kind: fewer bytes than the raw tensors (unchanged chunks
    count as written by none) and single-thread encode / decode MB/s of the changed chunks, for
    the earlier engine (before), today's (after) and the peers measured."""
    coders: list[str] = []
    for rows in per_scenario.values():
        for r in rows.values():
            coders += [k for k, v in r.items() if isinstance(v, dict) and k not in coders]
    head = " | ".join(f"{c}: ratio, enc / dec MB/s" for c in coders)
    lines = [
        f"| scenario | tensors | dtype | MB | unchanged | {head} |",
        "|---|---|---|---:|---:|" + "---:|" * len(coders),
    ]
    for scenario, rows in per_scenario.items():
        for name, r in rows.items():
            cells = []
            for c in coders:
                m = r.get(c)
                cells.append(
                    "-"
                    if not m
                    else f"{_f(m['ratio'])}x, {_f(m['encode_MBps'], 0)} / {_f(m['decode_MBps'], 0)}"
                )
            lines.append(
                f"| {scenario} | {name} | {r['dtype']} | {r['logical_bytes'] / 1e6:.1f} | "
                f"{r['unchanged_bytes'] / max(r['logical_bytes'], 1):.0%} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [
        "",
        f"Today's codec on {THREADS} threads, the same changed chunks (wall clock, best of "
        f"{PASSES} passes). Encode *steady*: as a save codes them, each place racing the "
        f"predictors every {HINT_TTL}th save and coded as at its last save otherwise; *race*: "
        "every chunk raced (the first save after a restart); *remembered*: none raced.",
        "",
    ]
    lines += [
        "| scenario | encode MB/s, steady | race | remembered | decode MB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for scenario, rows in per_scenario.items():
        whole = rows.get("all", {})
        lines.append(
            f"| {scenario} | {_f(whole.get('encode_2t_MBps'), 0)} | "
            f"{_f(whole.get('encode_2t_race_MBps'), 0)} | "
            f"{_f(whole.get('encode_2t_hinted_MBps'), 0)} | "
            f"{_f(whole.get('decode_2t_MBps'), 0)} |"
        )
    return "\n".join(lines)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
