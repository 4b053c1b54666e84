"""Run one scenario: train, checkpoint with every system on the same state, restore, record."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import analysis
from benchmarks.harness.memory import peak_extra_rss
from benchmarks.harness.scenarios import Params, Scenario, Workload
from benchmarks.harness.state import clone, first_difference, tensor_bytes
from benchmarks.harness.systems import SYSTEMS, System


@dataclass
class RunSettings:
    params: Params
    checkpoints: int
    systems: list[str]
    store_options: dict[str, Any] = field(default_factory=dict)
    restore_every: bool = True  # restore after every checkpoint (else after the last only)
    analyze: bool = False
    workdir: Path = Path("bench_out")
    keep: bool = False
    # torch threads while training (0: torch's default). Training only produces the states; on a
    # shared 2-core machine one thread avoids OpenMP's slow-down under contention. Saves and
    # restores always run with torch's default.
    train_threads: int = 1


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_scenario(
    scenario: Scenario, settings: RunSettings
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Records (one per system and checkpoint) and, with ``analyze``, the per-category
    compression breakdown of the last checkpoint against the one before."""
    settings.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{scenario.name}-", dir=settings.workdir))
    work = scenario.build(settings.params)
    systems: list[System] = [
        SYSTEMS[name](root / name, settings.store_options) for name in settings.systems
    ]
    for system in systems:
        system.attach(work, lambda: scenario.build(settings.params))
    # Everything alive now (imported frameworks, the model) lives through the scenario: keep it
    # out of the collections before every save and restore, which it would otherwise slow down.
    gc.collect()
    gc.freeze()
    records: list[dict[str, Any]] = []
    breakdown = None
    previous = None
    totals = {s.name: 0 for s in systems}
    step = 0
    _log(f"[{scenario.name}] {work.info}")
    try:
        for index in range(settings.checkpoints):
            steps = work.steps_before(index)
            start = time.perf_counter()
            loss = _train(work, steps, settings.train_threads)
            train_s = time.perf_counter() - start
            step += steps
            state = work.state(step)
            logical = tensor_bytes(state)
            by_system: dict[str, dict[str, Any]] = {}
            # Rotate the order so that no system always follows the same one.
            order = systems[index % len(systems) :] + systems[: index % len(systems)]
            for system in order:
                with peak_extra_rss() as peak:
                    stats = system.save(state, index, step)
                totals[system.name] += stats.bytes_written
                record = {
                    "scenario": scenario.name,
                    "system": system.name,
                    "checkpoint": index,
                    "step": step,
                    "train_steps": steps,
                    "train_s": train_s,
                    "loss": loss,
                    "bytes_logical": logical,
                    "bytes_written": stats.bytes_written,
                    "bytes_total": totals[system.name],
                    "disk_bytes": system.disk_bytes(),
                    "stall_s": stats.stall_s,
                    "save_s": stats.save_s,
                    "restore_s": None,
                    "restore_ok": None,
                    # resident-set high-water mark over the save, minus the resident set before
                    "peak_extra_bytes": peak.extra_bytes,
                    "restore_peak_extra_bytes": None,
                    "fsync": system.fsync,
                    "order": order.index(system),
                    "loadavg_1m": os.getloadavg()[0],
                    **work.info,
                    **stats.extra,
                }
                records.append(record)
                by_system[system.name] = record
                # The next system starts with no dirty pages of this one being written back: a
                # system that does not fsync (the Lightning IOs, Accelerate) leaves hundreds of
                # MB for the kernel to flush, which slowed whichever system came next (its
                # snapshot stalled 2-4x longer). Untimed.
                os.sync()
            if settings.restore_every or index == settings.checkpoints - 1:
                _restore_all(order, state, by_system)
            _log(_progress(scenario.name, index, steps, train_s, by_system))
            if settings.analyze and index == settings.checkpoints - 1 and previous is not None:
                breakdown = analysis.breakdown(
                    previous,
                    state,
                    chunk_size=settings.store_options.get("chunk_size", 4 << 20),
                    level=settings.store_options.get("compression_level", 1),
                )
            if settings.analyze and index == settings.checkpoints - 2:
                previous = clone(state)
            del state
    finally:
        for system in systems:
            system.close()
        del systems, work, previous
        gc.unfreeze()
        gc.collect()
        if not settings.keep:
            shutil.rmtree(root, ignore_errors=True)
    return records, breakdown


def _train(work: Workload, steps: int, threads: int) -> float | None:
    default = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return work.train(steps)
    finally:
        torch.set_num_threads(default)


def _restore_all(
    systems: list[System], state: dict[str, Any], by_system: dict[str, dict[str, Any]]
) -> None:
    """Restore the newest checkpoint of every system (files were just written: all of them are
    likely in the page cache alike) and check it equals the saved state bit for bit."""
    for system in systems:
        with peak_extra_rss() as peak:
            start = time.perf_counter()
            restored = system.restore()
            elapsed = time.perf_counter() - start
        record = by_system[system.name]
        record["restore_s"] = elapsed
        record["restore_peak_extra_bytes"] = peak.extra_bytes
        record["decode_MBps"] = record["bytes_logical"] / elapsed / 1e6
        diff = first_difference(restored, state)
        record["restore_ok"] = diff is None
        if diff is not None:
            record["restore_error"] = f"restored state differs at {diff}"
            _log(f"  !! {system.name}: restored state differs at {diff}")
        del restored


def _progress(
    name: str, index: int, steps: int, train_s: float, by_system: dict[str, dict[str, Any]]
) -> str:
    parts = [f"[{name}] ckpt {index} (+{steps} steps, {train_s:.1f}s)"]
    for system, r in by_system.items():
        restore = f" restore {r['restore_s']:.2f}s" if r["restore_s"] is not None else ""
        parts.append(
            f"{system}: {r['bytes_written'] / 1e6:.1f}MB stall {r['stall_s']:.3f}s "
            f"save {r['save_s']:.2f}s{restore}"
        )
    return " | ".join(parts)
