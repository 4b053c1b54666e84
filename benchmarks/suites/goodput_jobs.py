"""What one goodput job runs, in its own process: train the LM for ``warmup + steps`` optimizer
steps with one checkpointing system, and time the last ``steps`` of them.

The clock starts after step ``warmup`` (and its save, if one is due there) once every save
still in flight has finished (untimed), and stops when training has ended and every checkpoint
is durable: Lightning's ``fit`` has returned (our callback's and the plug-in's teardown wait for
their background saves, ``ModelCheckpoint`` saves synchronously, ``AsyncCheckpointIO``'s
teardown joins its thread, the DCP callback waits for its last future at the end of training);
in the Accelerate loop, after the loop the system's pending saves are waited for. Then,
untimed for the overhead, the newest checkpoint is restored in the same process (the restart
figure). The job writes one JSON record to ``spec["result"]``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.model import (
    FULL,
    QUICK,
    ModelConfig,
    TinyLM,
    lightning_lm,
    lm_loss,
    token_data,
)

LIGHTNING_SYSTEMS = (
    "none",
    "callback",
    "plugin",
    "modelcheckpoint",
    "async_io",
    "dcp_async",
    "callback_budget",
    "callback_unyielding",
)
ACCELERATE_SYSTEMS = ("none", "incremental", "save_state", "dcp_async")
WORKLOADS = {"lightning": LIGHTNING_SYSTEMS, "accelerate": ACCELERATE_SYSTEMS}
ADAPTIVE = {"callback_budget"}  # choose their own interval: run once per regime
UNYIELDING = {"background_nice": 0, "workers": 2, "codec_effort": "full"}  # earlier versions
BUDGET = 0.02  # callback_budget: max_overhead


def unavailable(system: str) -> str | None:
    """Why ``system`` cannot run with the installed library (an option it needs is missing),
    or None."""
    if system == "callback_budget":
        from lightning_incremental import IncrementalCheckpoint

        if "max_overhead" not in inspect.signature(IncrementalCheckpoint).parameters:
            return "IncrementalCheckpoint has no max_overhead parameter"
    if system == "callback_unyielding":
        from lightning_incremental.core.config import StoreConfig

        if "background_nice" not in {f.name for f in dataclasses.fields(StoreConfig)}:
            return "StoreConfig has no background_nice field"
    return None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_tree(path: Path) -> None:
    for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DcpAsync:
    """``torch.distributed.checkpoint.async_save`` of a state every ``every`` steps, without a
    process group (as ``benchmarks/harness/systems.py``): one directory per save,
    ``FileSystemWriter`` (files fsynced), directories fsynced once the future is done. The
    previous save's future is waited for before the next save starts; ``wait`` waits for the
    last."""

    def __init__(self, root: Path, every: int) -> None:
        import torch.distributed.checkpoint as dcp

        import benchmarks.harness.systems  # noqa: F401 - silences DCP's single-process warning

        self.dcp, self.root, self.every = dcp, root, every
        self.future: Any = None
        self.steps: list[int] = []

    def maybe_save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        if step % self.every:
            return
        self.wait()
        path = self.root / f"step-{step:06d}"
        self.future = self.dcp.async_save(
            state(), storage_writer=self.dcp.FileSystemWriter(path), no_dist=True
        )
        self.steps.append(step)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
            _fsync_tree(self.root)

    def restore(self, state: dict[str, Any]) -> None:
        newest = self.root / f"step-{self.steps[-1]:06d}"
        self.dcp.load(state, storage_reader=self.dcp.FileSystemReader(newest), no_dist=True)


def _incremental_restore(root: Path) -> None:
    from lightning_incremental.core import CheckpointStore
    from lightning_incremental.core.format.canonical import forget_parsed

    forget_parsed()  # as a resuming process: manifests not already parsed
    store = CheckpointStore(str(root))
    try:
        store.load()
    finally:
        store.close()


def _ckpt_step(path: Path) -> int:
    return int(path.stem.rsplit("step=", 1)[1])


def _ckpt_steps(root: Path) -> list[int]:
    """Steps of ModelCheckpoint's ``epoch=E-step=S.ckpt`` files."""
    return sorted(_ckpt_step(p) for p in root.glob("*step=*.ckpt"))


# ---------------------------------------------------------------------------- Lightning


def run_lightning(spec: dict[str, Any], cfg: ModelConfig, root: Path) -> dict[str, Any]:
    import logging

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_incremental import IncrementalCheckpoint, IncrementalCheckpointIO
    from lightning_incremental.core import CheckpointStore

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    system, k, warmup = spec["system"], spec["interval"], spec["warmup"]
    total = warmup + spec["steps"]
    data: Any = token_data(cfg, total)

    class Dcp(L.Callback):
        def __init__(self) -> None:
            self.saver = DcpAsync(root, k)

        def on_train_batch_end(self, trainer: L.Trainer, module: Any, *rest: Any) -> None:
            self.saver.maybe_save(
                trainer.global_step,
                lambda: {"model": module.state_dict(), "optim": trainer.optimizers[0].state_dict()},
            )

        def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
            self.saver.wait()

    callbacks: list[Any] = []
    plugins: list[Any] = []
    # steady state: no extra save when training ends (ModelCheckpoint makes none either)
    ours: dict[str, Any] = {"save_on_train_end": False}
    if system == "callback":
        callbacks.append(IncrementalCheckpoint(root, every_n_train_steps=k, **ours))
    elif system == "callback_unyielding":
        cb = IncrementalCheckpoint(root, every_n_train_steps=k, store_options=UNYIELDING, **ours)
        callbacks.append(cb)
    elif system == "callback_budget":
        budget: dict[str, Any] = {"max_overhead": BUDGET, **ours}  # a newer option
        callbacks.append(IncrementalCheckpoint(root, **budget))
    elif system in ("plugin", "modelcheckpoint", "async_io"):
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=k, save_top_k=-1))
        if system == "plugin":
            plugins.append(IncrementalCheckpointIO())
        elif system == "async_io":
            plugins.append(AsyncCheckpointIO())
    elif system == "dcp_async":
        callbacks.append(Dcp())
    elif system != "none":
        raise ValueError(f"unknown Lightning system {system!r}")
    clock: dict[str, float] = {}

    def drain(trainer: L.Trainer) -> None:
        """Finish every save still in flight (untimed, before the clock starts)."""
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, IncrementalCheckpoint):
                cb.wait()
            elif isinstance(cb, Dcp):
                cb.saver.wait()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, IncrementalCheckpointIO):
            io.wait()
        elif isinstance(io, AsyncCheckpointIO):
            io.teardown()  # joins its thread; the next save starts a new one

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, i: int) -> None:
            if i == warmup:
                drain(trainer)
                clock["start"] = time.perf_counter()

    trainer = L.Trainer(
        max_steps=total,
        max_epochs=1,
        accelerator="gpu" if spec.get("device") == "cuda" else "cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Clock(), *callbacks],
        plugins=plugins,
        default_root_dir=root,
    )
    module = lightning_lm(cfg, data)
    trainer.fit(module)
    timed = time.perf_counter() - clock["start"]
    assert trainer.global_step == total, trainer.global_step

    steps: list[int] = []
    restore: Callable[[], None] | None = None
    if system.startswith("callback"):
        store = CheckpointStore(str(root))
        steps = store.steps()
        store.close()
        restore = lambda: _incremental_restore(root)  # noqa: E731
    elif system == "plugin" and (steps := _ckpt_steps(root)):
        newest = max(root.glob("*step=*.ckpt"), key=_ckpt_step)

        def restore() -> None:
            from lightning_incremental.core.format.canonical import forget_parsed

            forget_parsed()
            plugin = IncrementalCheckpointIO()
            try:
                plugin.load_checkpoint(newest)
            finally:
                plugin.teardown()

    elif system in ("modelcheckpoint", "async_io") and (steps := _ckpt_steps(root)):
        newest = max(root.glob("*step=*.ckpt"), key=_ckpt_step)
        restore = lambda: torch.load(newest, map_location="cpu", weights_only=False)  # noqa: E731
    elif system == "dcp_async":
        saver = next(c for c in callbacks if isinstance(c, Dcp)).saver
        steps = saver.steps
        optimizer = trainer.optimizers[0]
        restore = lambda: saver.restore(  # noqa: E731
            {"model": module.state_dict(), "optim": optimizer.state_dict()}
        )
    # callback_budget: the intervals the callback chose, and why (its ``cadence``)
    cadence = next((c.cadence for c in callbacks if getattr(c, "cadence", None)), None)
    choices = [dataclasses.asdict(c) for c in getattr(cadence, "choices", [])]
    return {"timed_s": timed, "saved_steps": steps, "restore": restore, "choices": choices}


# ---------------------------------------------------------------------------- Accelerate


def run_accelerate(spec: dict[str, Any], cfg: ModelConfig, root: Path) -> dict[str, Any]:
    from accelerate import Accelerator

    from accelerate_incremental import IncrementalCheckpointer

    system, k, warmup = spec["system"], spec["interval"], spec["warmup"]
    total = warmup + spec["steps"]
    accelerator = Accelerator(cpu=spec.get("device") != "cuda")
    model = TinyLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data: Any = token_data(cfg, total)
    loader: Any = torch.utils.data.DataLoader(data, batch_size=cfg.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt: IncrementalCheckpointer | None = None
    dcp: DcpAsync | None = None
    saved: list[int] = []

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    if system == "incremental":
        ckpt = IncrementalCheckpointer(accelerator, str(root), every_n_steps=k)
        batches: Any = ckpt.iterate(loader)  # the documented loop: the position is tracked
    else:
        batches = loader
        if system == "dcp_async":
            dcp = DcpAsync(root, k)
        elif system not in ("none", "save_state"):
            raise ValueError(f"unknown Accelerate system {system!r}")

    def after(step: int) -> None:
        if ckpt is not None:
            ckpt.maybe_save(step)
        elif dcp is not None:
            dcp.maybe_save(step, state)
        elif system == "save_state" and step % k == 0:
            accelerator.save_state(str(root / f"step-{step:06d}"))
            saved.append(step)

    def wait() -> None:
        if ckpt is not None:
            ckpt.wait()
        elif dcp is not None:
            dcp.wait()

    start = 0.0
    step = 0
    for batch in batches:
        loss = lm_loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        after(step)
        if step == warmup:
            wait()  # untimed: nothing in flight when the clock starts
            start = time.perf_counter()
    wait()
    timed = time.perf_counter() - start
    assert step == total, step

    restore: Callable[[], None] | None = None
    if ckpt is not None:
        saved = ckpt.steps()
        if not saved:
            ckpt.close()
        checkpointer = ckpt
        restore = lambda: _load_and_close(checkpointer)  # noqa: E731
    elif dcp is not None:
        saved = dcp.steps
        saver = dcp
        restore = lambda: saver.restore(state())  # noqa: E731
    elif system == "save_state" and saved:
        newest = root / f"step-{saved[-1]:06d}"
        restore = lambda: accelerator.load_state(str(newest))  # noqa: E731
    return {"timed_s": timed, "saved_steps": saved, "restore": restore}


def _load_and_close(ckpt: Any) -> None:
    try:
        ckpt.load()
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------- the job


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job as ``spec`` says (workload, system, regime, interval, warmup, steps, quick,
    dir); return its record."""
    if spec["regime"] == "free":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = QUICK if spec["quick"] else FULL
    root = Path(spec["dir"])
    root.mkdir(parents=True, exist_ok=True)
    run = run_lightning if spec["workload"] == "lightning" else run_accelerate
    out = run(spec, cfg, root)
    restore_s = None
    if out["restore"] is not None and out["saved_steps"]:
        start = time.perf_counter()
        out["restore"]()
        restore_s = time.perf_counter() - start
    saved = sorted(out["saved_steps"])
    choices = out.get("choices", [])
    warmup = spec["warmup"]
    return {
        **{key: spec[key] for key in ("workload", "system", "regime", "interval", "warmup")},
        "steps": spec["steps"],
        "repeat": spec.get("repeat", 0),
        "torch_threads": torch.get_num_threads(),
        "device": spec.get("device", "cpu"),
        "timed_s": out["timed_s"],
        "step_s": out["timed_s"] / spec["steps"],
        "saves": sum(1 for s in saved if s > warmup),  # saves inside the timed window
        "saves_total": len(saved),
        "saved_steps": saved,
        # the adaptive callback's own choices where it reports them, else the spacing of saves
        "chosen_intervals": [c["interval"] for c in choices]
        or [b - a for a, b in itertools.pairwise(saved)],
        "cadence_choices": choices,
        "bytes_on_disk": dir_bytes(root),
        "restore_s": restore_s,
    }


def job_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    record = run_job(spec)
    Path(spec["result"]).write_text(json.dumps(record))
