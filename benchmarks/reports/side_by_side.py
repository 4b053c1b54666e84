"""Summaries of the records of ``python -m benchmarks``: per scenario and system figures, goals,
the Markdown report."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

BASELINE = "torch_save"
ASYNC = "lightning_async"
OURS = "incremental"
OURS_IO = "incremental_io"


@dataclass
class Row:
    scenario: str
    system: str
    checkpoints: int
    fsync: bool
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
    encode_MBps: float | None  # mean over checkpoints that encoded anything (incremental)
    pipeline_MBps: float | None
    save_MBps: float | None  # state bytes / median time to durable
    decode_MBps: float | None  # state bytes / restore of the last checkpoint
    peak_extra: float | None  # mean over checkpoints of the save's peak extra resident bytes
    peak_extra_max: int | None
    restore_peak_extra: int | None  # restore of the last checkpoint
    ratio_per_ckpt: float | None = None  # torch_save bytes / these bytes, after the first
    ratio_total: float | None = None
    stall_vs_torch: float | None = None  # medians: this / torch_save's
    save_vs_torch: float | None = None  # medians of the time to durable: this / torch_save's
    restore_vs_torch: float | None = None  # restore_s / torch_save's, last checkpoint
    restore_vs_torch_median: float | None = None  # median over checkpoints of that ratio


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return mean(present) if present else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _row(scenario: str, system: str, recs: list[dict[str, Any]]) -> Row:
    later = recs[1:] or recs
    last = recs[-1]
    peaks = [r["peak_extra_bytes"] for r in recs if r.get("peak_extra_bytes") is not None]
    save_median = median(r["save_s"] for r in recs)
    return Row(
        scenario=scenario,
        system=system,
        checkpoints=len(recs),
        fsync=bool(last["fsync"]),
        logical_bytes=mean(r["bytes_logical"] for r in recs),
        first_bytes=recs[0]["bytes_written"],
        bytes_per_ckpt=mean(r["bytes_written"] for r in later),
        total_bytes=last["bytes_total"],
        stall_s=mean(r["stall_s"] for r in recs),
        stall_median=median(r["stall_s"] for r in recs),
        save_s=mean(r["save_s"] for r in recs),
        save_median=save_median,
        restore_s=last["restore_s"],
        restore_ok=None
        if all(r["restore_ok"] is None for r in recs)
        else all(r["restore_ok"] is not False for r in recs),
        encode_MBps=_mean([r.get("encode_MBps") for r in recs]),
        pipeline_MBps=_mean([r.get("pipeline_MBps") for r in recs]),
        save_MBps=_div(last["bytes_logical"] / 1e6, save_median),
        decode_MBps=last.get("decode_MBps"),
        peak_extra=mean(peaks) if peaks else None,
        peak_extra_max=max(peaks) if peaks else None,
        restore_peak_extra=last.get("restore_peak_extra_bytes"),
    )


def summarize(records: list[dict[str, Any]]) -> list[Row]:
    """One row per scenario and system, in the order the records first name them."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["scenario"], r["system"])].append(r)
    for recs in groups.values():
        recs.sort(key=lambda r: r["checkpoint"])
    rows = {key: _row(*key, recs) for key, recs in groups.items()}
    for (scenario, _), row in rows.items():
        base = rows.get((scenario, BASELINE))
        if base is None:
            continue
        if row.bytes_per_ckpt:
            row.ratio_per_ckpt = base.bytes_per_ckpt / row.bytes_per_ckpt
        row.ratio_total = base.total_bytes / row.total_bytes if row.total_bytes else None
        row.stall_vs_torch = _div(row.stall_median, base.stall_median)
        row.save_vs_torch = _div(row.save_median, base.save_median)
        if base.restore_s and row.restore_s is not None:
            row.restore_vs_torch = row.restore_s / base.restore_s
        pairs = [
            mine["restore_s"] / theirs["restore_s"]
            for mine, theirs in zip(groups[(scenario, row.system)], groups[(scenario, BASELINE)])
            if mine["restore_s"] is not None and theirs["restore_s"]
        ]
        row.restore_vs_torch_median = median(pairs) if pairs else None
    scenarios = list(dict.fromkeys(r["scenario"] for r in records))
    systems = list(dict.fromkeys(r["system"] for r in records))
    return sorted(
        rows.values(),
        key=lambda r: (scenarios.index(r.scenario), r.system != BASELINE, systems.index(r.system)),
    )


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run


def _find(rows: list[Row], scenario: str, system: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.system == system), None)


def _stall_goal(rows: list[Row], system: str, label: str) -> Goal:
    stalls = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        ours, theirs = _find(rows, scenario, system), _find(rows, scenario, ASYNC)
        if ours and theirs:
            stalls.append((scenario, ours.stall_median, theirs.stall_median))
    return Goal(
        f"{label} <= AsyncCheckpointIO's (median over checkpoints, every scenario; ms ours/theirs)",
        "<= 1.0x",
        ", ".join(f"{s} {a * 1e3:.0f}/{b * 1e3:.0f} ms" for s, a, b in stalls) or "-",
        all(a <= b for _, a, b in stalls) if stalls else None,
    )


CODEC_GOALS = ("dense_fp32", "bf16", "dense_fp32_trained", "bf16_trained")


def goals(rows: list[Row], breakdowns: dict[str, Any] | None = None) -> list[Goal]:
    """The goals, from the summary rows and (for the codec's own speed) the per-chunk analysis
    of ``--analyze``, when it ran."""
    out = []
    targets = (
        ("frozen90", 8.0),
        ("dense_fp32", 1.4),
        ("bf16", 2.4),
        ("dense_fp32_trained", 1.4),
        ("bf16_trained", 2.4),
    )
    for scenario, target in targets:
        row = _find(rows, scenario, OURS)
        ratio = row.ratio_per_ckpt if row else None
        out.append(
            Goal(
                f"{scenario}: bytes vs torch.save (per checkpoint after the first)",
                f">= {target}x",
                "-" if ratio is None else f"{ratio:.2f}x",
                None if ratio is None else ratio >= target,
            )
        )
    out.append(_stall_goal(rows, OURS, "stall"))
    out.append(_stall_goal(rows, OURS_IO, "IncrementalCheckpointIO in a Trainer: stall"))
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
    codec = [
        (name, whole["encode_2t_MBps"], whole.get("encode_2t_race_MBps"), whole["decode_2t_MBps"])
        for name, per_kind in (breakdowns or {}).items()
        if name in CODEC_GOALS
        for whole in [per_kind.get("all", {})]
        if whole.get("encode_2t_MBps") is not None
    ]
    out.append(
        Goal(
            "the codec on 2 threads, dense scenarios (the changed chunks of the last checkpoint, "
            "wall clock; MB/s encode as saves code them, in brackets with every chunk raced / "
            "decode)",
            ">= 1000 / 1500 MB/s",
            ", ".join(f"{s} {e:.0f} ({_n(r)}) / {d:.0f}" for s, e, r, d in codec) or "-",
            all(e >= 1000 and d >= 1500 for _, e, _, d in codec) if codec else None,
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


def load_range(records: list[dict[str, Any]]) -> str:
    loads = [r["loadavg_1m"] for r in records if r.get("loadavg_1m") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def _mem(value: float | None, state: float) -> str:
    if value is None:
        return "-"
    return f"{value / 1e6:.1f} ({value / state:.2f}x)" if state else f"{value / 1e6:.1f}"


def _header(machine: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    run = machine.get("run", {})
    return [
        "# lightning-incremental benchmark",
        "",
        f"Machine: {machine['cpu_available']} of {machine['cpu_count']} CPUs "
        f"({machine['cpu_model']}), {machine['ram_gib']} GiB RAM, Python {machine['python']}, "
        f"torch {machine['torch']}, lightning {machine['lightning']}, "
        f"accelerate {machine.get('accelerate')}, "
        f"lightning-incremental {machine['lightning_incremental']}"
        + (f" @ {machine['git_commit'][:10]}" if machine.get("git_commit") else "")
        + ".",
        "",
        f"Mode `{run.get('mode')}`: {run.get('checkpoints')} checkpoints every "
        f"{run.get('interval')} training steps (constant lr, random ids); transformer "
        f"{run.get('model')} (AdamW lr {run.get('lr')}); sparse_embedding model "
        f"{run.get('embedding_model')} (Adagrad); store options "
        f"{run.get('store_options') or 'default'}. Wall time "
        f"{run.get('wall_s', 0):.0f} s. Load average at start "
        f"{_loads(machine.get('loadavg_at_start'))}; during the saves "
        f"{load_range(records)} (other processes share these {machine['cpu_count']} cores: "
        "timings are noisy, medians are the robust figures)." + _scaling(machine),
        "",
    ]


def _scaling(machine: dict[str, Any]) -> str:
    """What the CPUs delivered during the run (see ``machine.parallel_scaling``), or ""."""
    start, end = machine.get("parallel_scaling_at_start"), machine.get("parallel_scaling_at_end")
    if start is None and end is None:
        return ""
    parts = [f"{start:.2f}x one's work at the start of the run"] if start else []
    if end:
        parts.append(f"{end:.2f}x at its end" if start else f"{end:.2f}x one's work at its end")
    figures = ", ".join(parts)
    return (
        f" {machine['cpu_available']} processes running the same loop did {figures} (virtual "
        "CPUs on a shared host can deliver less than their number: read the multi-thread "
        "figures against it)."
    )


def _absolute_table(rows: list[Row]) -> list[str]:
    lines = [
        "| scenario | system | state MB | MB / ckpt (after 1st) | total MB | "
        "stall s (mean / median) | to durable s (mean / median) | restore s (last) | "
        "save MB/s | decode MB/s | encode MB/s (pipeline) | "
        "peak extra MB, save (x state; mean / max) | peak extra MB, restore |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        restore = _s(r.restore_s) + ("" if r.restore_ok in (None, True) else " (WRONG)")
        encode = "-" if r.encode_MBps is None else f"{_n(r.encode_MBps)} ({_n(r.pipeline_MBps)})"
        lines.append(
            f"| {r.scenario} | {r.system} | {_mb(r.logical_bytes)} | {_mb(r.bytes_per_ckpt)} | "
            f"{_mb(r.total_bytes)} | {_s(r.stall_s)} / {_s(r.stall_median)} | "
            f"{_s(r.save_s)}{'' if r.fsync else '*'} / {_s(r.save_median)} | {restore} | "
            f"{_n(r.save_MBps)} | {_n(r.decode_MBps)} | {encode} | "
            f"{_mem(r.peak_extra, r.logical_bytes)} / {_mb(r.peak_extra_max)} | "
            f"{_mem(r.restore_peak_extra, r.logical_bytes)} |"
        )
    return lines


def _ratio_table(rows: list[Row]) -> list[str]:
    lines = [
        "| scenario | system | bytes / ckpt: torch_save ÷ this | total bytes: torch_save ÷ "
        "this | stall: this ÷ torch_save | to durable: this ÷ torch_save | "
        "restore: this ÷ torch.load (last / median) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.system == BASELINE:
            continue
        lines.append(
            f"| {r.scenario} | {r.system} | {_x(r.ratio_per_ckpt)} | {_x(r.ratio_total)} | "
            f"{_x(r.stall_vs_torch)} | {_x(r.save_vs_torch)} | "
            f"{_x(r.restore_vs_torch)} / {_x(r.restore_vs_torch_median)} |"
        )
    return lines


NOTES = [
    "- *stall*: time the training loop is blocked by one save. Blocking systems (torch_save, "
    "lightning_torch, dcp_save, accelerate) stall for the whole save; lightning_async and "
    "dcp_async for their copy of every tensor; incremental for its snapshot to host memory.",
    "- *to durable*: from the call until the checkpoint is durable: fsynced for torch_save, "
    "incremental, dcp_save and dcp_async (files by DCP's `FileSystemWriter`, directories by the "
    "harness); marked `*`: written but not fsynced (lightning_torch, lightning_async, "
    "accelerate: neither Lightning nor Accelerate fsyncs).",
    "- *restore*: load of the newest checkpoint after each save, compared bit for bit with the "
    "saved state: `torch.load(weights_only=True)` of the file (torch_save and both Lightning "
    "IOs); `dcp.load` into a state allocated from the saved layout; Accelerate `load_state` into "
    "a freshly built model and optimizer; a fresh `CheckpointStore(...).load()` (base + delta "
    "chain, every chunk verified). The page cache cannot be dropped here: every system's files "
    "were just written and are likely cached alike, so restores are warm-cache figures. Systems "
    "run in a rotating order at each checkpoint, with the page cache's dirty pages flushed "
    "between them (untimed). The restore ratio's median pairs each "
    "checkpoint's restore with torch.load's.",
    "- *save MB/s*: state bytes / median time to durable; *decode MB/s*: state bytes / restore "
    "of the last checkpoint (their ratios to torch.save are the inverses of the time ratios). "
    "*encode MB/s* (incremental only): state bytes / the engine's encode_s (XOR, byte grouping, "
    "zstd; summed over worker threads, hashing excluded); in brackets the pipeline MB/s, state "
    "bytes / wall time from the end of the snapshot to commit (hashing, encoding, writing, "
    "fsync).",
    "- *peak extra*: the process's resident-set high-water mark during the save (until durable, "
    "background threads included) or the restore (the restored state included), minus the "
    "resident set before it; the kernel's `VmHWM`, reset through `/proc/self/clear_refs` after a "
    "`gc.collect()` and `malloc_trim(0)` (benchmarks/harness/memory.py: resident pages only, "
    "page-granular). In brackets as a multiple of the state size. No ratio to torch.save: it "
    "streams every tensor straight into the file and its extra memory is ~0, so any ratio to it "
    "is unbounded.",
]


def markdown(
    machine: dict[str, Any],
    records: list[dict[str, Any]],
    rows: list[Row],
    goal_list: list[Goal],
    breakdown_md: str | None = None,
    summaries: dict[str, str] | None = None,
) -> str:
    lines = _header(machine, records)
    if summaries:
        present = dict.fromkeys(r.system for r in rows)
        lines += [f"- `{name}`: {summaries[name]}" for name in present if name in summaries]
        lines.append("")
    lines += _absolute_table(rows)
    lines += ["", "Ratios to torch.save (same scenario, same states):", ""]
    lines += _ratio_table(rows)
    lines += ["", *NOTES]
    lines.append(
        "- Every restored state was compared with the saved one bit for bit"
        + (
            " — all identical."
            if all(r.restore_ok in (None, True) for r in rows)
            else " — SOME DIFFER (marked WRONG)."
        )
    )
    lines += [
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
