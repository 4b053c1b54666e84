"""The big-state sweep: five saves of a state of 8 float32 tensors, every tensor changed in
place before each after the first, against a copy into existing buffers, ``torch.save`` +
fsync and ``torch.load``, with the peak extra host memory of a save."""

from __future__ import annotations

import math
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.memory import peak_extra_rss
from benchmarks.harness.state import tensor_bytes
from benchmarks.harness.timing import torch_save
from benchmarks.suites.scale import measure
from benchmarks.suites.scale.figures import (
    COPY_STALL_TARGET,
    DURABLE_TARGET,
    PEAK_MEMORY_TARGET_X,
    RESTORE_TARGET,
    record,
)

BIG_TENSORS = 8
CHAIN = 5


def big_state(nbytes: int) -> dict[str, Any]:
    numel = max(1, nbytes // 4 // BIG_TENSORS)
    return reset_big_state({"model": {f"w{i}": torch.empty(numel) for i in range(BIG_TENSORS)}})


def reset_big_state(state: dict[str, Any]) -> dict[str, Any]:
    """The big state's first values again, in place (``randn`` after seed 0): every attempt
    saves the same five states. Carried over from the attempt before, ``add_(1)`` would move
    values already far from zero by a nearly constant integer step, whose deltas code to
    almost nothing (a 4 MiB chunk's ``sub`` delta: 0.47x raw at the fourth save, 0.04x at the
    14th), and the later attempts would measure another workload."""
    torch.manual_seed(0)
    for t in state["model"].values():
        t.normal_()
    return state


class CopyBound:
    """Copies of every tensor into buffers allocated (and touched) beforehand: the
    memory-bandwidth bound of a snapshot. Timed right before each steady save, not once
    before the sweep: on this host the same copy took 28 ms in one run and 44 ms in another
    (and 29-51 ms within one process), so only copies timed beside the saves compare."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.src = list(state["model"].values())
        self.dst = [torch.empty_like(t) for t in self.src]
        self.best = math.inf
        self.measure(1)  # faulted in: the bound is the copy, not the page faults
        self.best = math.inf  # ... nor this first copy

    def measure(self, repeats: int) -> None:
        """Time ``repeats`` copies; ``best`` keeps the fastest so far."""
        for _ in range(repeats):
            started = time.perf_counter()
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s)
            self.best = min(self.best, time.perf_counter() - started)


def chain_makeup(store_dir: Path, step: int) -> str:
    """What a restore of ``step`` decodes: its chunks by how each is stored (a delta: at which
    depth, its links to decode on top of its root), and the bytes it reads against the raw bytes.

    It varies from run to run, and the restore's time with it: under ``codec_effort="auto"``
    (the default) a save whose background thread waited for a CPU longer than it ran stores its
    changed chunks as they are (codec ``s``), and the next save's deltas then have such roots;
    a chunk stored as it is restores at copy speed, a coded one at the codec's, a delta at
    about the sum of its root's and its own."""
    from lightning_incremental.core import CheckpointStore

    with CheckpointStore(str(store_dir)) as store:
        doc = store.manifest(step).to_dict()
    chunks = doc["chunks"]
    kinds: Counter[str] = Counter()
    read = raw = 0
    for tensor in doc["tensors"]:
        for digest in tensor["chunks"]:
            recipe = root = chunks[digest]
            while root.get("base"):
                root = chunks[root["base"]]
            plain = root["kind"] == "s"
            if recipe["depth"]:
                on = "a root stored as it is" if plain else "a coded root"
                kinds[f"deltas at depth {recipe['depth']} on {on}"] += 1
            else:
                kinds["stored as they are" if plain else "coded standalone"] += 1
            read += recipe["chain"] or recipe["length"]
            raw += recipe["size"]
    parts = ", ".join(f"{n} {what}" for what, n in sorted(kinds.items()))
    count = sum(kinds.values())
    return f"restored {count} chunks ({parts}), reading {read / raw:.2f}x their raw bytes"


def big_sweep(nbytes: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """The big-state figures for a state of about ``nbytes`` in 8 tensors."""
    from lightning_incremental.core import CheckpointStore

    state = big_state(nbytes)
    size = tensor_bytes(state)
    gb = size / 1e9
    case = f"{gb:.3g} GB in {BIG_TENSORS} tensors"
    copy = CopyBound(state)
    plain = root / "big.pt"
    with peak_extra_rss() as plain_peak:
        torch_save(state, plain)
    store_dir, kept = root / "big-store", root / "big-baseline"
    stalls, durables, peaks, baselines = [], [], {}, []
    efforts: list[tuple[str, float]] = []
    for attempt in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        reset_big_state(state)
        with CheckpointStore(store_dir) as store:
            for step in range(1, CHAIN + 1):
                if step > 1:
                    for t in state["model"].values():
                        t.add_(1)
                if step in (1, 4) and attempt == 0:
                    with peak_extra_rss() as peak:
                        measure.timed_save(store, state, step)
                    peaks[step] = peak.extra_bytes
                    steady = False
                else:
                    if step == 3:
                        copy.measure(3)  # the bound, timed beside the save it bounds
                    steady = step >= 3  # snapshot buffers recycled
                    stall, durable = measure.timed_save(
                        store, state, step, efforts if steady else None
                    )
                    if step == 3:
                        stalls.append(stall)
                    if steady:
                        durables.append(durable)
                # Each of our saves followed by torch.save of the same state into a new file:
                # the same disk state for both, the same bytes kept on it; the time to durable
                # compares the steady saves (the third on) with the torch.save after each.
                plain_s = measure.new_file_save(state, kept)
                if steady:
                    baselines.append(plain_s)
    shutil.rmtree(kept, ignore_errors=True)
    copy.dst.clear()  # the restores below run with the memory they had before
    baseline = min(baselines)
    torch_load = measure.fresh_restore("torch", plain, repeats)
    base_load = measure.fresh_restore("ours", store_dir, repeats, step=1)
    chain_load = measure.fresh_restore("ours", store_dir, repeats, step=CHAIN)
    makeup = chain_makeup(store_dir, CHAIN)
    rows = [
        record(
            "big",
            case,
            gb,
            "stall, steady save",
            min(stalls),
            copy.best,
            "copy into existing buffers",
            "s",
            COPY_STALL_TARGET,
        ),
        record(
            "big",
            case,
            gb,
            "time to durable, steady save",
            min(durables),
            baseline,
            "torch.save + fsync",
            "s",
            DURABLE_TARGET,
            detail=measure.efforts_detail(efforts, efforts[durables.index(min(durables))]),
        ),
        record(
            "big",
            case,
            gb,
            "restore of the full base, fresh process",
            base_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
        ),
        record(
            "big",
            case,
            gb,
            f"restore of a chain of {CHAIN} saves, fresh process",
            chain_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
            detail=f"step {CHAIN} of the chain {makeup}",
        ),
    ]
    plain_x = None if plain_peak.extra_bytes is None else plain_peak.extra_bytes / size
    for step, label in ((1, "first save"), (4, "steady save")):
        if peaks.get(step) is not None:
            rows.append(
                record(
                    "big",
                    case,
                    gb,
                    f"peak extra host memory, {label} (x state)",
                    peaks[step] / size,
                    plain_x,
                    "torch.save + fsync",
                    "x",
                    PEAK_MEMORY_TARGET_X,
                    absolute=True,
                )
            )
    shutil.rmtree(store_dir, ignore_errors=True)
    plain.unlink(missing_ok=True)
    return rows
