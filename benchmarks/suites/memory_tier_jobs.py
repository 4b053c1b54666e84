"""One job of the memory tier's goodput benchmark (``memory_tier_goodput.py``), in its own
process: train the LM with one system (``none``, ``store50``, ``memory``) for ``warmup`` untimed
and ``steps`` timed steps, in a Lightning ``Trainer`` or an Accelerate loop, while a thread
samples the process's anonymous resident memory and the bytes of its memory directory (a
tmpfs). The record: the timed seconds, the peaks, the files of the newest memory part."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STORE_EVERY = 50


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Sampler:
    """Peak of (anonymous resident memory + the memory directory's bytes), every ``every`` s."""

    def __init__(self, memdir: Path, every: float = 0.02) -> None:
        self.memdir, self.every = memdir, every
        self.peak_anon = self.peak_tmpfs = self.peak_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            anon = _status_kib("RssAnon") * 1024
            tmpfs = _tree_bytes(self.memdir)
            self.peak_anon = max(self.peak_anon, anon)
            self.peak_tmpfs = max(self.peak_tmpfs, tmpfs)
            self.peak_sum = max(self.peak_sum, anon + tmpfs)
            if self._stop.wait(self.every):
                return


def _part_sizes(memdir: Path) -> dict[str, int] | None:
    """The files of the newest visible part in ``memdir`` (any job directory)."""
    parts = sorted(p for p in memdir.glob("*/s*-g*-r*") if p.is_dir())
    if not parts:
        return None
    return {f.name: f.stat().st_size for f in parts[-1].iterdir()}


def _lightning(spec: dict[str, Any], root: Path, memdir: Path) -> float:
    import logging

    import lightning.pytorch as L

    from benchmarks.harness.model import FULL, QUICK, lightning_lm, token_data
    from lightning_incremental import IncrementalCheckpoint

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    cfg = QUICK if spec["quick"] else FULL
    warmup, total = spec["warmup"], spec["warmup"] + spec["steps"]
    data: Any = token_data(cfg, total)

    callbacks: list[Any] = []
    if spec["system"] != "none":
        memory = {"memory_every_n_train_steps": 1} if spec["system"] == "memory" else {}
        ours = IncrementalCheckpoint(
            root,
            every_n_train_steps=STORE_EVERY,
            save_on_train_end=False,
            memory_dir=memdir,
            **memory,
        )
        callbacks.append(ours)
    clock: dict[str, float] = {}

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i == warmup:
                for cb in callbacks:
                    cb.wait()
                clock["start"] = time.perf_counter()

    trainer = L.Trainer(
        max_steps=total,
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Clock(), *callbacks],
        default_root_dir=root,
    )
    trainer.fit(lightning_lm(cfg, data))
    assert trainer.global_step == total, trainer.global_step
    return time.perf_counter() - clock["start"]


def _accelerate(spec: dict[str, Any], root: Path, memdir: Path) -> float:
    import torch
    from accelerate import Accelerator

    from accelerate_incremental import IncrementalCheckpointer
    from benchmarks.harness.model import FULL, QUICK, TinyLM, lm_loss, token_data

    cfg = QUICK if spec["quick"] else FULL
    warmup, total = spec["warmup"], spec["warmup"] + spec["steps"]
    accelerator = Accelerator(cpu=True)
    model = TinyLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader: Any = torch.utils.data.DataLoader(token_data(cfg, total), batch_size=cfg.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = None
    if spec["system"] != "none":
        memory = {"memory_every_n_steps": 1} if spec["system"] == "memory" else {}
        ckpt = IncrementalCheckpointer(
            accelerator, str(root), every_n_steps=STORE_EVERY, memory_dir=str(memdir), **memory
        )
    batches = ckpt.iterate(loader) if ckpt is not None else loader
    start, step = 0.0, 0
    for batch in batches:
        accelerator.backward(lm_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if ckpt is not None:
            ckpt.maybe_save(step)
        if step == warmup:
            if ckpt is not None:
                ckpt.wait()
            start = time.perf_counter()
    if ckpt is not None:
        ckpt.wait()
    timed = time.perf_counter() - start
    assert step == total, step
    if ckpt is not None:
        spec["_close"] = ckpt.close  # after the part's size is read
    return timed


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["regime"] == "free":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    root = Path(spec["dir"]) / "store"
    memdir = Path(tempfile.mkdtemp(prefix="li-bench-memory-", dir=spec["memory_root"]))
    try:
        run = _lightning if spec["workload"] == "lightning" else _accelerate
        with Sampler(memdir) as sampler:
            timed = run(spec, root, memdir)
        parts = _part_sizes(memdir)
        close = spec.pop("_close", None)
        if close is not None:
            close()
    finally:
        shutil.rmtree(memdir, ignore_errors=True)
    return {
        **{k: spec[k] for k in ("workload", "system", "regime", "warmup", "steps", "repeat")},
        "torch_threads": torch.get_num_threads(),
        "timed_s": timed,
        "step_s": timed / spec["steps"],
        "peak_rss_anon": sampler.peak_anon,
        "peak_tmpfs": sampler.peak_tmpfs,
        "peak_node": sampler.peak_sum,
        "part_files": parts,
    }
