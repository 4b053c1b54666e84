"""What the sweeps time: a save (its stall and its time to durable), a restore in a fresh
process, and ``torch.save`` + fsync into a new file."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.state import tensor_bytes
from benchmarks.harness.timing import torch_save


def child(kind: str, path: str, step: int | None) -> None:
    """One restore, timed in this fresh process (imports done first); prints one JSON line."""
    from lightning_incremental.core import CheckpointStore

    gc.collect()
    started = time.perf_counter()
    if kind == "torch":
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = CheckpointStore(path).load(step)
    seconds = time.perf_counter() - started
    assert tensor_bytes(loaded) > 0
    print(json.dumps({"seconds": seconds}))


def fresh_restore(kind: str, path: Path, repeats: int, step: int | None = None) -> float:
    """Best seconds of ``repeats`` restores, each in a new process."""
    command = [sys.executable, "-m", "benchmarks.suites.scale", "--child", kind]
    command += ["--path", str(path)]
    command += ["--step", str(step)] if step is not None else []
    best = math.inf
    for _ in range(repeats):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{kind} restore of {path} failed:\n{done.stderr[-3000:]}")
        best = min(best, json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    return best


def timed_save(
    store: Any, state: dict[str, Any], step: int, efforts: list[tuple[str, float]] | None = None
) -> tuple[float, float]:
    """(stall, time to durable) of one save: the ``save`` call, and ``save`` to ``result()``;
    the effort it used (``SaveResult.effort``) and the share of its changed chunks it stored as
    they are are appended to ``efforts``."""
    started = time.perf_counter()
    handle = store.save(state, step=step)
    stall = time.perf_counter() - started
    result = handle.result()
    durable = time.perf_counter() - started
    if efforts is not None:
        changed = result.chunks_full + result.chunks_delta
        efforts.append((result.effort, result.chunks_as_is / changed if changed else 0.0))
    return stall, durable


def efforts_detail(efforts: list[tuple[str, float]], fastest: tuple[str, float]) -> str:
    """What ``codec_effort="auto"`` chose for the timed saves (``timed_save``'s ``efforts``):
    the time to durable of a dense save depends on it (a save coded in full runs at the codec's
    speed, one stored as it is at the disk's; a paced one codes what the disk's time allows)."""
    count = {e: sum(1 for effort, _ in efforts if effort == e) for e in ("fast", "full", "paced")}
    shares = [share for effort, share in efforts if effort == "paced"]
    paced = f"{count['paced']} were paced"
    if shares:
        paced += f" (stored {100 * min(shares):.0f}-{100 * max(shares):.0f} % of them as they are)"
    said = {"fast": "stored them as they are", "full": "coded them", "paced": "was paced"}
    return (
        f'the steady saves timed for durability under codec_effort="auto": {count["fast"]} of '
        f"{len(efforts)} stored their changed chunks as they are, {count['full']} coded them in "
        f"full, {paced}; the fastest {said.get(fastest[0], fastest[0])}"
    )


def new_file_save(state: Any, directory: Path) -> float:
    """Seconds of ``torch.save`` + fsync into a new file in ``directory``, kept there (the
    caller removes the directory).

    A new file, as each of our saves writes new objects: on a disk that allocates blocks
    lazily (a thin-provisioned virtual disk, as cloud machines have), writing over a file's
    blocks again costs a fraction of writing new ones (1 GB rewritten in place: 0.67 s; into a
    new file once a few were kept: 2.9 s, on the machine of the results below). A baseline
    that rewrites one file would measure the disk's reuse of warm blocks, not ``torch.save``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    return torch_save(state, directory / f"{len(list(directory.iterdir()))}.pt")
