"""The goodput benchmark's figures: the best job per system and cell, overheads against the
no-checkpoint run of the same cell, derived figures (cost per save, expected lost work per
failure, Young/Daly's interval), the goals, and the Markdown report."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.suites.goodput_jobs import WORKLOADS

BASELINE = "none"
OURS = "callback"  # the goals are about the Lightning callback


def _cell_key(record: dict[str, Any]) -> tuple[str, str, int | None]:
    return (record["workload"], record["regime"], record["interval"])


def _system_figures(
    best: dict[str, Any], runs: list[dict[str, Any]], none: dict[str, Any] | None, mtbf_s: float
) -> dict[str, Any]:
    steps = best["steps"]
    fig: dict[str, Any] = {
        "timed_s": best["timed_s"],
        "timed_s_all": [r["timed_s"] for r in runs],
        "step_s": best["step_s"],
        "saves": best["saves"],
        "saves_total": best["saves_total"],
        "bytes_on_disk": best["bytes_on_disk"],
        "bytes_per_save": best["bytes_on_disk"] / best["saves_total"] if best["saves_total"] else 0,
        "restore_s": best["restore_s"],
        "chosen_intervals": best["chosen_intervals"],
    }
    if none is None:
        return fig
    base, base_step_s = none["timed_s"], none["timed_s"] / steps
    added = best["timed_s"] - base
    fig["added_s"] = added
    fig["overhead"] = added / base
    interval = best["interval"]
    if interval is None and best["chosen_intervals"]:
        interval = statistics.mean(best["chosen_intervals"])
    cost = added / best["saves"] if best["saves"] else None
    fig["cost_per_save_s"] = cost
    if interval is not None and best["restore_s"] is not None:
        # a failure falls, on average, half an interval after the last checkpoint
        fig["lost_work_s"] = 0.5 * interval * best["step_s"] + best["restore_s"]
    if cost is not None and cost > 0:
        optimum = math.sqrt(2 * cost * mtbf_s)
        fig["young_daly_s"] = optimum
        fig["young_daly_steps"] = optimum / base_step_s
    return fig


def summarize(records: list[dict[str, Any]], mtbf_hours: float) -> dict[str, Any]:
    """Per (workload, regime, interval): the no-checkpoint time and every system's figures,
    each from its fastest job; the goals."""
    ok = [r for r in records if "error" not in r]
    cells: dict[tuple[str, str, int | None], dict[str, list[dict[str, Any]]]] = {}
    for r in ok:
        cells.setdefault(_cell_key(r), {}).setdefault(r["system"], []).append(r)
    # the baseline of a cell: its own none, else one of the same workload, regime and steps
    baselines: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in sorted(ok, key=lambda r: r["timed_s"], reverse=True):
        if r["system"] == BASELINE:
            baselines[(r["workload"], r["regime"], r["steps"])] = r
    out = []
    for (workload, regime, interval), by_system in cells.items():
        bests = {name: min(runs, key=lambda r: r["timed_s"]) for name, runs in by_system.items()}
        steps = next(iter(bests.values()))["steps"]
        none = bests.get(BASELINE) or baselines.get((workload, regime, steps))
        order = [s for s in WORKLOADS.get(workload, ()) if s in bests]
        order += sorted(set(bests) - set(order))
        systems = {
            name: _system_figures(bests[name], by_system[name], none, mtbf_hours * 3600)
            for name in order
        }
        out.append(
            {
                "workload": workload,
                "regime": regime,
                "interval": interval,
                "steps": steps,
                "none_s": none["timed_s"] if none else None,
                "systems": systems,
            }
        )
    summary: dict[str, Any] = {
        "mtbf_hours": mtbf_hours,
        "cells": out,
        "failed": [
            {k: r.get(k) for k in ("workload", "system", "regime", "interval")}
            for r in records
            if "error" in r
        ],
    }
    summary["goals"] = goals(summary)
    return summary


def _find(summary: dict[str, Any], regime: str, interval: int) -> dict[str, Any] | None:
    for cell in summary["cells"]:
        if (cell["workload"], cell["regime"], cell["interval"]) == ("lightning", regime, interval):
            return dict(cell["systems"])
    return None


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.1f} %"


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals, each with what was measured and ``met`` (None: not measured in this run)."""
    found = []
    cell = _find(summary, "all", 10)
    ours = (cell or {}).get(OURS, {}).get("added_s")
    theirs = (cell or {}).get("modelcheckpoint", {}).get("added_s")
    if ours is None or theirs is None:
        met, measured = None, "not measured"
    else:
        met = ours <= theirs / 3
        measured = f"callback +{ours:.2f} s, modelcheckpoint +{theirs:.2f} s"
        if theirs > 0:
            measured += f" ({ours / theirs:.2f}x)"
    found.append(
        {
            "name": "all cores, every 10 steps: callback's added time <= 1/3 of ModelCheckpoint's",
            "measured": measured,
            "met": met,
        }
    )
    for interval, limit in ((10, 0.02), (1, 0.05)):
        cell = _find(summary, "free", interval)
        overhead = (cell or {}).get(OURS, {}).get("overhead")
        found.append(
            {
                "name": f"a core free, every {interval} steps: callback overhead <= "
                f"{100 * limit:.0f} %",
                "measured": _pct(overhead) if overhead is not None else "not measured",
                "met": None if overhead is None else overhead <= limit,
            }
        )
    return found


# ---------------------------------------------------------------------------- Markdown


def _column(cell: dict[str, Any]) -> str:
    k = cell["interval"]
    regime = {"all": "all cores", "free": "a core free"}.get(cell["regime"], cell["regime"])
    return f"{regime}, {'auto' if k is None else f'every {k}'}"


def _systems(cells: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for cell in cells:
        names += [n for n in cell["systems"] if n not in names]
    return sorted(names, key=lambda n: (n != BASELINE, names.index(n)))


def _table(cells: list[dict[str, Any]], rows: list[str], value: Any) -> list[str]:
    lines = [
        "| system | " + " | ".join(_column(c) for c in cells) + " |",
        "| --- |" + " ---: |" * len(cells),
    ]
    for name in rows:
        values = []
        for cell in cells:
            fig = cell["systems"].get(name)
            values.append("" if fig is None else value(fig, cell))
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    return lines + [""]


def _num(fmt: str, key: str, scale: float = 1.0) -> Any:
    def cell(fig: dict[str, Any], _: dict[str, Any]) -> str:
        v = fig.get(key)
        return "—" if v is None else format(v * scale, fmt)

    return cell


def _young_daly(fig: dict[str, Any], _: dict[str, Any]) -> str:
    if fig.get("young_daly_s") is None:
        return "—"
    return f"{fig['young_daly_steps']:.0f} steps / {fig['young_daly_s']:.0f} s"


def _intervals(fig: dict[str, Any], _: dict[str, Any]) -> str:
    return ", ".join(map(str, fig["chosen_intervals"])) or "—"


def _repeats(repeats: dict[str, int]) -> str:
    """``{"lightning all 10": 2, ...}`` as "2 jobs: lightning all 10, ...; 1 job: ..."."""
    groups: dict[int, list[str]] = {}
    for cell, n in repeats.items():
        groups.setdefault(n, []).append(cell)
    if len(groups) == 1:
        n = next(iter(groups))
        return f"{n} job{'s' * (n > 1)} each"
    return "; ".join(
        f"{n} job{'s' * (n > 1)}: {', '.join(cells)}" for n, cells in sorted(groups.items())[::-1]
    )


def markdown(doc: dict[str, Any]) -> str:
    machine, settings, summary = doc["machine"], doc["settings"], doc["summary"]
    lines = [
        "# Goodput: training time lost to checkpointing",
        "",
        f"Machine: {machine.get('cpu_model')}, {machine.get('cpu_available')} CPUs, "
        f"{machine.get('ram_gib')} GiB; torch {machine.get('torch')}, lightning "
        f"{machine.get('lightning')}, accelerate {machine.get('accelerate')}, "
        f"lightning-incremental {machine.get('lightning_incremental')} "
        f"(commit {str(machine.get('git_commit'))[:10]}). Load average at the start "
        f"{settings['loadavg_start'][0]:.2f}, at the end {settings['loadavg_end'][0]:.2f}; "
        f"the run took {settings['elapsed_s'] / 60:.1f} min.",
        "",
        f"Model {settings['model']}; untimed warm-up steps ({_warmup(settings['warmup'])}), then "
        f"the timed steps; each figure is the best of its jobs ({_repeats(settings['repeats'])}). "
        "Timed: from after the warm-up, nothing in flight, to the end of "
        "training with every checkpoint durable. Overhead = (T_system - T_none) / T_none in the "
        "same cell. Regimes: *all cores* trains with torch's default threads, *a core free* "
        "with one thread.",
        "",
    ]
    for workload, why in settings.get("skipped", {}).items():
        for system, reason in why.items():
            lines.append(f"- {workload} `{system}` skipped: {reason}")
    if any(settings.get("skipped", {}).values()):
        lines.append("")
    for failed in summary.get("failed", []):
        lines.append(f"- FAILED: {failed}")
    if summary.get("failed"):
        lines.append("")
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for cell in summary["cells"]:
        by_workload.setdefault(cell["workload"], []).append(cell)
    for workload, cells in by_workload.items():
        fixed = [c for c in cells if c["interval"] is not None]
        adaptive = [c for c in cells if c["interval"] is None]
        rows = [n for n in _systems(fixed) if n != BASELINE]
        lines += [f"## {workload.capitalize()}", ""]
        lines += ["Training-time overhead of checkpointing, % (best job against best `none`):", ""]
        lines += _table(fixed, rows, _num("+.1f", "overhead", 100))
        lines += ["No-checkpoint training (`none`): timed steps and seconds per step.", ""]
        lines += _table(
            fixed,
            [BASELINE],
            lambda f, c: f"{c['steps']} x {f['step_s']:.3f} s",
        )
        lines += ["Saves inside the timed window (all saves of the job in brackets):", ""]
        lines += _table(fixed, rows, lambda f, c: f"{f['saves']} ({f['saves_total']})")
        lines += ["MB on disk per save (the directory at the end / all saves):", ""]
        lines += _table(fixed, rows, _num(".1f", "bytes_per_save", 1e-6))
        lines += ["Added seconds per save, C = (T_system - T_none) / saves:", ""]
        lines += _table(fixed, rows, _num(".2f", "cost_per_save_s"))
        lines += [
            "Restart: seconds to load the newest checkpoint in the job (page cache warm):",
            "",
        ]
        lines += _table(fixed, rows, _num(".2f", "restore_s"))
        lines += [
            "Expected lost work per failure, seconds: half an interval of training (at the "
            "system's own step time) + the restart above:",
            "",
        ]
        lines += _table(fixed, rows, _num(".1f", "lost_work_s"))
        lines += [
            f"Young/Daly optimum interval √(2 · C · MTBF), MTBF {summary['mtbf_hours']:g} h "
            "(steps of no-checkpoint training / seconds; — where C ≤ 0 or no save):",
            "",
        ]
        lines += _table(fixed, rows, _young_daly)
        if adaptive:
            rows = [n for n in _systems(adaptive) if n != BASELINE]
            lines += ["Adaptive interval (the system picks its own): overhead, %", ""]
            lines += _table(adaptive, rows, _num("+.1f", "overhead", 100))
            lines += [
                "Saves in the window: the intervals it chose (its own report, else the spacing "
                "of its saves):",
                "",
            ]
            lines += _table(adaptive, rows, lambda f, c: f"{f['saves']}: {_intervals(f, c)}")
    lines += ["## Goals", "", "| goal | measured | met |", "| --- | --- | --- |"]
    for goal in summary["goals"]:
        met = {True: "met", False: "**not met**", None: "not measured"}[goal["met"]]
        lines.append(f"| {goal['name']} | {goal['measured']} | {met} |")
    return "\n".join(lines) + "\n"


def _warmup(warmup: object) -> str:
    if isinstance(warmup, int):
        return str(warmup)
    return "2, and one save first where saves come every 1 or 10 steps: interval + 2"
