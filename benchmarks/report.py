"""Summaries of the records: per scenario and system figures, goals, the Markdown report."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

BASELINE = "torch_save"
ASYNC = "lightning_async"
OURS = "incremental"


@dataclass
class Row:
    scenario: str
    system: str
    checkpoints: int
    logical_bytes: float  # tensor bytes per checkpoint (mean)
    first_bytes: int  # bytes written by the first checkpoint
    bytes_per_ckpt: float  # mean bytes written by the checkpoints after the first
    total_bytes: int  # bytes written by all checkpoints
    stall_s: float  # mean over checkpoints
    stall_median: float
    save_s: float  # mean over checkpoints
    save_median: float
    restore_s: float | None  # restore of the newest (last) checkpoint
    restore_ok: bool | None  # every restore was bit-identical
    encode_MBps: float | None  # mean over checkpoints that encoded anything
    pipeline_MBps: float | None
    decode_MBps: float | None  # restore of the last checkpoint
    ratio_per_ckpt: float | None = None  # torch_save bytes / these bytes, after the first
    ratio_total: float | None = None
    restore_vs_torch: float | None = None  # restore_s / torch_save's, last checkpoint
    restore_vs_torch_median: float | None = None  # median over checkpoints of that ratio


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return mean(present) if present else None


def summarize(records: list[dict[str, Any]]) -> list[Row]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["scenario"], r["system"])].append(r)
    rows: dict[tuple[str, str], Row] = {}
    for (scenario, system), recs in groups.items():
        recs.sort(key=lambda r: r["checkpoint"])
        later = recs[1:] or recs
        last = recs[-1]
        rows[(scenario, system)] = Row(
            scenario=scenario,
            system=system,
            checkpoints=len(recs),
            logical_bytes=mean(r["bytes_logical"] for r in recs),
            first_bytes=recs[0]["bytes_written"],
            bytes_per_ckpt=mean(r["bytes_written"] for r in later),
            total_bytes=last["bytes_total"],
            stall_s=mean(r["stall_s"] for r in recs),
            stall_median=median(r["stall_s"] for r in recs),
            save_s=mean(r["save_s"] for r in recs),
            save_median=median(r["save_s"] for r in recs),
            restore_s=last["restore_s"],
            restore_ok=None
            if all(r["restore_ok"] is None for r in recs)
            else all(r["restore_ok"] is not False for r in recs),
            encode_MBps=_mean([r.get("encode_MBps") for r in recs]),
            pipeline_MBps=_mean([r.get("pipeline_MBps") for r in recs]),
            decode_MBps=last.get("decode_MBps"),
        )
    for (scenario, _), row in rows.items():
        base = rows.get((scenario, BASELINE))
        if base is None:
            continue
        if row.bytes_per_ckpt:
            row.ratio_per_ckpt = base.bytes_per_ckpt / row.bytes_per_ckpt
        row.ratio_total = base.total_bytes / row.total_bytes if row.total_bytes else None
        if base.restore_s and row.restore_s is not None:
            row.restore_vs_torch = row.restore_s / base.restore_s
        pairs = [
            mine["restore_s"] / theirs["restore_s"]
            for mine, theirs in zip(groups[(scenario, row.system)], groups[(scenario, BASELINE)])
            if mine["restore_s"] is not None and theirs["restore_s"]
        ]
        row.restore_vs_torch_median = median(pairs) if pairs else None
    return sorted(rows.values(), key=lambda r: (r.scenario, r.system != BASELINE, r.system))


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run


def _row(rows: list[Row], scenario: str, system: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.system == system), None)


def goals(rows: list[Row]) -> list[Goal]:
    out = []
    for scenario, target in (("frozen90", 8.0), ("dense_fp32", 1.4), ("bf16", 2.4)):
        row = _row(rows, scenario, OURS)
        ratio = row.ratio_per_ckpt if row else None
        out.append(
            Goal(
                f"{scenario}: bytes vs torch.save (per checkpoint after the first)",
                f">= {target}x",
                "-" if ratio is None else f"{ratio:.2f}x",
                None if ratio is None else ratio >= target,
            )
        )
    scenarios = sorted({r.scenario for r in rows})
    stalls = []
    for s in scenarios:
        ours, theirs = _row(rows, s, OURS), _row(rows, s, ASYNC)
        if ours and theirs:
            stalls.append((s, ours.stall_median, theirs.stall_median))
    out.append(
        Goal(
            "stall <= AsyncCheckpointIO's (median over checkpoints, every scenario; "
            "ms ours/theirs)",
            "<= 1.0x",
            ", ".join(f"{s} {a * 1e3:.0f}/{b * 1e3:.0f} ms" for s, a, b in stalls) or "-",
            all(a <= b for _, a, b in stalls) if stalls else None,
        )
    )
    restores = [
        (r.scenario, r.restore_vs_torch_median)
        for r in rows
        if r.system == OURS and r.restore_vs_torch_median is not None
    ]
    out.append(
        Goal(
            "restore <= 1.5x torch.load (median over checkpoints of the paired ratio, every "
            "scenario)",
            "<= 1.5x",
            ", ".join(f"{s} {v:.2f}x" for s, v in restores) or "-",
            all(v <= 1.5 for _, v in restores) if restores else None,
        )
    )
    encodes = [
        (r.scenario, r.encode_MBps, r.pipeline_MBps)
        for r in rows
        if r.system == OURS and r.encode_MBps is not None and r.scenario != "unchanged"
    ]
    out.append(
        Goal(
            "encode >= 500 MB/s on this machine (bytes_logical / encode_s; in brackets the "
            "wall-clock pipeline MB/s)",
            ">= 500 MB/s",
            ", ".join(f"{s} {v:.0f} ({_n(w)})" for s, v, w in encodes) or "-",
            all(v >= 500 for _, v, _ in encodes) if encodes else None,
        )
    )
    return out


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _loads(values: list[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def _load_range(records: list[dict[str, Any]]) -> str:
    loads = [r["loadavg_1m"] for r in records if r.get("loadavg_1m") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def markdown(
    machine: dict[str, Any],
    records: list[dict[str, Any]],
    rows: list[Row],
    goal_list: list[Goal],
    breakdown_md: str | None = None,
) -> str:
    run = machine.get("run", {})
    lines = [
        "# lightning-incremental benchmark",
        "",
        f"Machine: {machine['cpu_available']} of {machine['cpu_count']} CPUs "
        f"({machine['cpu_model']}), {machine['ram_gib']} GiB RAM, Python {machine['python']}, "
        f"torch {machine['torch']}, lightning {machine['lightning']}, "
        f"lightning-incremental {machine['lightning_incremental']}"
        + (f" @ {machine['git_commit'][:10]}" if machine.get("git_commit") else "")
        + ".",
        "",
        f"Mode `{run.get('mode')}`: {run.get('checkpoints')} checkpoints every "
        f"{run.get('interval')} training steps (AdamW, constant lr {run.get('lr')}, random "
        f"tokens); model {run.get('model')}; store options "
        f"{run.get('store_options') or 'default'}. Load average at start "
        f"{_loads(machine.get('loadavg_at_start'))}; during the saves "
        f"{_load_range(records)} (other processes share these {machine['cpu_count']} cores: "
        "timings are noisy, medians are the robust figures).",
        "",
        "| scenario | system | state MB | MB / ckpt (after 1st) | total MB | "
        "torch_save ÷ bytes (per ckpt / total) | stall s (mean / median) | "
        "save s (mean / median) | restore s (last) | restore ÷ torch.load (last / median) | "
        "encode MB/s | pipeline MB/s | decode MB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        restore = _s(r.restore_s) + ("" if r.restore_ok in (None, True) else " (WRONG)")
        lines.append(
            f"| {r.scenario} | {r.system} | {_mb(r.logical_bytes)} | {_mb(r.bytes_per_ckpt)} | "
            f"{_mb(r.total_bytes)} | {_x(r.ratio_per_ckpt)} / {_x(r.ratio_total)} | "
            f"{_s(r.stall_s)} / {_s(r.stall_median)} | {_s(r.save_s)} / {_s(r.save_median)} | "
            f"{restore} | {_x(r.restore_vs_torch)} / {_x(r.restore_vs_torch_median)} | "
            f"{_n(r.encode_MBps)} | {_n(r.pipeline_MBps)} | {_n(r.decode_MBps)} |"
        )
    lines += [
        "",
        "- *stall*: time the training loop is blocked by one save (mean and median over "
        "checkpoints). "
        "torch_save blocks for the whole save; lightning_async for its clone of every tensor; "
        "incremental for its snapshot to host memory.",
        "- *save*: from the call until the checkpoint is durable (torch_save, incremental: "
        "fsynced; lightning_async: written, Lightning does not fsync).",
        "- *restore*: load of the newest checkpoint after the last save — `torch.load("
        "weights_only=True)` of the file; a fresh `CheckpointStore(...).load()` (base + delta "
        "chain, every chunk verified). The page cache cannot be dropped here: every system's "
        "files were just written and are likely cached alike, so restore times are "
        "warm-cache figures for all systems. Systems run in a rotating order at each "
        "checkpoint. The ratio's median pairs each checkpoint's restore with torch.load's.",
        "- *encode MB/s*: state bytes / the engine's encode_s (XOR, byte grouping, zstd; "
        "summed over worker threads, hashing excluded). *pipeline MB/s*: state bytes / wall "
        "time from the end of the snapshot to commit (hashing, encoding, writing, fsync). "
        "*decode MB/s*: state bytes / restore_s.",
        "- Every restored state was compared with the saved one bit for bit"
        + (
            " — all identical."
            if all(r.restore_ok in (None, True) for r in rows)
            else " — SOME DIFFER (marked WRONG)."
        ),
        "",
        "## Goals",
        "",
        "| goal | target | measured | met |",
        "|---|---|---|---|",
    ]
    for g in goal_list:
        met = "-" if g.met is None else ("yes" if g.met else "**no**")
        lines.append(f"| {g.name} | {g.target} | {g.measured} | {met} |")
    if breakdown_md:
        lines += [
            "",
            "## Where the bytes go (last checkpoint vs the one before, engine codec per chunk)",
            "",
            breakdown_md,
        ]
    return "\n".join(lines) + "\n"
