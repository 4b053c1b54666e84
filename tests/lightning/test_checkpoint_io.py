"""IncrementalCheckpointIO on real Trainers: ModelCheckpoint rotation, resume, evaluation from
``best_model_path``, async error delivery, and bad input (construction, pointer files, stores)."""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_incremental import IncrementalCheckpointIO
from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    FormatVersionError,
    NotAStoreError,
    PickleNotAllowedError,
    StorageError,
    StoreConfig,
    UnsupportedValueError,
)
from lightning_incremental.core.storage import open_storage
from lightning_incremental.lightning.checkpoint_io import PointerError
from lightning_incremental.lightning.pointers import document
from tests.conftest import assert_state_equal
from tests.faulty import FaultyStorage, SlowStorage

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*weights_only.*:UserWarning"),
]

FEATURES, WIDTH, SAMPLES, BATCH = 128, 512, 32, 4  # 8 steps per epoch
STEPS_PER_EPOCH = SAMPLES // BATCH


class Net(pl.LightningModule):
    """A frozen backbone (like fine-tuning) and a trainable head; no dropout, so runs are
    deterministic on CPU."""

    def __init__(self, lr: float = 0.01, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Linear(FEATURES, WIDTH)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=self.hparams["lr"])
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]


class OtherNet(Net):
    """A different architecture: its keys do not match Net's."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2)
        del self.head
        self.head2 = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head2(torch.relu(self.backbone(x)))


class RecordingIO(IncrementalCheckpointIO):
    """Keeps what TorchCheckpointIO would have written for each path (torch.save bytes of the
    very dict Lightning handed over), to compare loads against and to count bytes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: dict[str, bytes] = {}
        self.saves = 0
        self.torch_bytes_written = 0

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        self.saved[os.fspath(path)] = buf.getvalue()
        self.saves += 1
        self.torch_bytes_written += len(buf.getvalue())
        super().save_checkpoint(checkpoint, path, storage_options)

    def expected(self, path: str) -> dict[str, Any]:
        return torch.load(io.BytesIO(self.saved[path]), weights_only=False)


class CrashAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def data(n: int = SAMPLES) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    ds = TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(ds, batch_size=BATCH, shuffle=False)


class GroupDestroyedAtExit(pl.Callback):
    """Destroys the default process group when a ddp_spawn child exits, while its interpreter
    is still whole. Lightning destroys it at exit for NCCL only; a gloo group left alive holds
    its worker threads' work (tensors with Python references) into the interpreter's teardown,
    and a child now and then aborts there (SIGABRT, "terminate called without an active
    exception") after its fit is done (pytorch/pytorch#179291)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        atexit.register(_destroy_group)


def _destroy_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def fit_past_a_teardown_abort(
    t: pl.Trainer, model: pl.LightningModule, done: Any, **kwargs: Any
) -> None:
    """``t.fit`` under ddp_spawn. A child's SIGABRT is tolerated only once ``done()`` shows the
    fit's work finished on every rank: the abort of a gloo group's teardown (see
    GroupDestroyedAtExit, which removes its cause; this is the backstop, since it came about
    one CI run in ten and never in a hundred runs alone)."""
    try:
        t.fit(model, data(), **kwargs)
    except ProcessExitedException as exc:
        if exc.signal_name != "SIGABRT" or not done():
            raise


def trainer(
    root: Path,
    plugin: IncrementalCheckpointIO | None,
    callbacks: Iterable[pl.Callback] = (),
    **kwargs: Any,
) -> pl.Trainer:
    callbacks = list(callbacks)
    if kwargs.get("strategy") == "ddp_spawn":
        callbacks.append(GroupDestroyedAtExit())
    kwargs.setdefault("limit_val_batches", 2)
    return pl.Trainer(
        default_root_dir=root,
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def net(seed: int = 0, **hparams: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**hparams)


def pointer(path: str | Path) -> dict[str, Any]:
    """The JSON document of a pointer file (after its header)."""
    return json.loads(document(Path(path).read_bytes()))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ckpt_files(directory: Path) -> set[str]:
    return {str(p) for p in directory.iterdir() if p.suffix == ".ckpt"}


def state(seed: int = 0, **extra: Any) -> dict[str, Any]:
    """A Lightning-like checkpoint dict for tests that call the plug-in directly."""
    torch.manual_seed(seed)
    return {
        "epoch": 0,
        "global_step": seed,
        "state_dict": {"w": torch.randn(64, 64), "b": torch.zeros(64)},
        **extra,
    }


# ---------------------------------------------------------------------- ModelCheckpoint


def test_top_k_rotation_and_last_keep_exact_checkpoints(tmp_path: Path, record_property) -> None:
    plugin = RecordingIO()
    ckpts = tmp_path / "ckpts"
    mc = ModelCheckpoint(
        dirpath=ckpts,
        monitor="train_loss",
        save_top_k=2,
        every_n_train_steps=2,
        save_last=True,
    )
    t = trainer(tmp_path, plugin, [mc], max_steps=5 * STEPS_PER_EPOCH)
    t.fit(net(), data())  # teardown waited for every pending save

    kept = ckpt_files(ckpts)
    assert kept == set(mc.best_k_models) | {mc.last_model_path}
    assert len(kept) == 3
    assert plugin.saves >= 25 and len(plugin.saved) >= 8  # many saves, most rotated away
    for path in set(plugin.saved) - kept:
        assert not os.path.exists(path), f"{path} was removed by top-k but still exists"
    for path in kept:
        assert_state_equal(plugin.load_checkpoint(path), plugin.expected(path), path)
    best = plugin.load_checkpoint(mc.best_model_path)
    assert_state_equal(best["state_dict"], plugin.expected(mc.best_model_path)["state_dict"])

    # The store holds exactly the steps that files point to: no leaked checkpoints.
    store_dir = ckpts / ".incremental"
    with CheckpointStore(store_dir) as store:
        assert sorted(store.steps()) == sorted(pointer(p)["step"] for p in kept)
        assert all(store.verify(s).ok for s in store.steps())

    store_bytes = dir_bytes(store_dir)
    torch_kept = sum(len(plugin.saved[p]) for p in kept)
    kept_ratio = torch_kept / store_bytes
    written_ratio = plugin.torch_bytes_written / store_bytes
    record_property("torch_kept_bytes", torch_kept)
    record_property("torch_written_bytes", plugin.torch_bytes_written)
    record_property("store_bytes", store_bytes)
    print(
        f"\n{plugin.saves} saves; kept {len(kept)}: torch.save files {torch_kept} B, "
        f"store {store_bytes} B ({kept_ratio:.2f}x smaller); all torch.save writes "
        f"{plugin.torch_bytes_written} B ({written_ratio:.1f}x)"
    )
    assert kept_ratio > 2.0
    assert written_ratio > 10.0


def test_same_name_twice_gets_a_version_suffix_and_keeps_every_top_k(tmp_path: Path) -> None:
    """ModelCheckpoint names a second save of one epoch "-v1" only if the first file exists
    right after its save: the pointer must be there before the commit."""

    def run(plugin: IncrementalCheckpointIO | None, directory: Path) -> ModelCheckpoint:
        mc = ModelCheckpoint(
            dirpath=directory,
            filename="{epoch}",
            every_n_train_steps=2,
            save_top_k=3,
            monitor="train_loss",
        )
        trainer(tmp_path, plugin, [mc], max_epochs=1).fit(net(), data())
        return mc

    plain = run(None, tmp_path / "plain")
    plugin = SlowCommits()
    mc = run(plugin, tmp_path / "ckpts")
    names = {Path(p).name for p in ckpt_files(tmp_path / "ckpts")}
    assert names == {Path(p).name for p in ckpt_files(tmp_path / "plain")}
    assert names == {"epoch=0.ckpt", "epoch=0-v1.ckpt", "epoch=0-v2.ckpt"}
    assert {Path(p).name for p in mc.best_k_models} == names
    assert Path(mc.best_model_path).name == Path(plain.best_model_path).name
    assert float(mc.best_model_score) == float(plain.best_model_score)
    best = plugin.load_checkpoint(mc.best_model_path)
    assert_state_equal(best["state_dict"], torch.load(plain.best_model_path)["state_dict"])
    with CheckpointStore(tmp_path / "ckpts" / ".incremental") as store:
        kept = sorted(pointer(p)["step"] for p in ckpt_files(tmp_path / "ckpts"))
        assert sorted(store.steps()) == kept and len(kept) == 3


def test_save_last_link_and_resume_from_last(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    ckpts = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=ckpts, save_top_k=1, every_n_train_steps=4, save_last="link")
    trainer(tmp_path, plugin, [mc], max_steps=STEPS_PER_EPOCH).fit(net(), data())

    last = ckpts / "last.ckpt"
    assert last.is_symlink()
    assert os.path.realpath(last) == os.path.realpath(mc.best_model_path)
    assert ckpt_files(ckpts) == {str(last), mc.best_model_path}
    with CheckpointStore(ckpts / ".incremental") as store:
        assert store.steps() == [pointer(mc.best_model_path)["step"]]

    mc2 = ModelCheckpoint(dirpath=ckpts, save_top_k=1, every_n_train_steps=4, save_last="link")
    t = trainer(tmp_path, plugin, [mc2], max_steps=2 * STEPS_PER_EPOCH)
    t.fit(net(seed=1), data(), ckpt_path="last")
    assert t.ckpt_path == str(last)
    assert t.global_step == 2 * STEPS_PER_EPOCH
    assert plugin.load_checkpoint(last)["global_step"] == 2 * STEPS_PER_EPOCH


def test_crash_then_resume_from_last_is_bit_identical(tmp_path: Path) -> None:
    """A run that crashes after a checkpoint and resumes with ckpt_path="last" ends with the
    same weights, bit for bit, as a run that was never interrupted (checkpoint at an epoch
    boundary: Lightning alone restarts a plain DataLoader's epoch from its first batch)."""
    total = 2 * STEPS_PER_EPOCH

    def callbacks(directory: Path, *extra: pl.Callback) -> list[pl.Callback]:
        return [
            ModelCheckpoint(dirpath=directory, every_n_train_steps=STEPS_PER_EPOCH, save_last=True),
            *extra,
        ]

    reference = net()
    trainer(tmp_path, IncrementalCheckpointIO(), callbacks(tmp_path / "a"), max_steps=total).fit(
        reference, data()
    )

    crashed = tmp_path / "b"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(
            tmp_path,
            IncrementalCheckpointIO(),
            callbacks(crashed, CrashAt(STEPS_PER_EPOCH + 3)),
            max_steps=total,
        ).fit(net(), data())
    assert pointer(crashed / "last.ckpt")["global_step"] == STEPS_PER_EPOCH

    resumed = net(seed=7)  # different init: everything must come from the checkpoint
    t = trainer(tmp_path, IncrementalCheckpointIO(), callbacks(crashed), max_steps=total)
    t.fit(resumed, data(), ckpt_path="last")
    assert t.global_step == total
    assert_state_equal(resumed.state_dict(), reference.state_dict())
    for a, b in zip(t.optimizers[0].state.values(), reference.trainer.optimizers[0].state.values()):
        assert_state_equal(a, b)


def test_validate_test_predict_from_best_model_path(tmp_path: Path) -> None:
    plugin = RecordingIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss", save_top_k=1)
    t = trainer(tmp_path, plugin, [mc], max_steps=3 * STEPS_PER_EPOCH)
    t.fit(net(), data(), data())
    best = mc.best_model_path
    assert Path(best).exists()

    reference = net(seed=5)
    reference.load_state_dict(plugin.expected(best)["state_dict"])
    plain = trainer(tmp_path, None)
    want_val = plain.validate(reference, data(), verbose=False)
    want_test = plain.test(reference, data(), verbose=False)
    want_pred = plain.predict(reference, data())

    assert t.validate(net(seed=5), data(), ckpt_path=best, verbose=False) == want_val
    assert t.test(net(seed=6), data(), ckpt_path="best", verbose=False) == want_test
    got_pred = t.predict(net(seed=7), data(), ckpt_path=best)
    assert got_pred is not None and want_pred is not None
    for got, want in zip(got_pred, want_pred):
        assert torch.equal(got, want)


def test_plain_torch_checkpoints_still_load(tmp_path: Path) -> None:
    """Runs that add the plug-in can resume from checkpoints written before (torch.save)."""
    mc = ModelCheckpoint(dirpath=tmp_path / "old", save_last=True)
    trainer(tmp_path, None, [mc], max_steps=STEPS_PER_EPOCH).fit(net(), data())
    old = tmp_path / "old" / "last.ckpt"
    plugin = IncrementalCheckpointIO()
    assert_state_equal(plugin.load_checkpoint(old), torch.load(old, weights_only=False))

    t = trainer(tmp_path, plugin, max_steps=2 * STEPS_PER_EPOCH)
    t.fit(net(), data(), ckpt_path=old)
    assert t.global_step == 2 * STEPS_PER_EPOCH
    new = tmp_path / "new" / "model.ckpt"
    t.save_checkpoint(new)
    plugin.wait()
    assert pointer(new)["global_step"] == 2 * STEPS_PER_EPOCH
    plugin.remove_checkpoint(old)  # a plain file is removed as TorchCheckpointIO would
    assert not old.exists()


def test_checkpoint_of_a_different_model_names_the_keys(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    t = trainer(tmp_path, plugin, max_steps=2)
    t.fit(net(), data())
    path = tmp_path / "net.ckpt"
    t.save_checkpoint(path)
    plugin.wait()
    with pytest.raises(RuntimeError) as info:
        trainer(tmp_path, plugin).validate(OtherNet(), data(), ckpt_path=path)
    message = str(info.value)
    assert "Missing key(s) in state_dict" in message and '"head2.weight"' in message
    assert "Unexpected key(s) in state_dict" in message and '"head.weight"' in message


# ---------------------------------------------------------------------- pointers and removal


class Instrumented(IncrementalCheckpointIO):
    """Stores on FaultyStorage, to hold or fail a background save's writes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.storages: list[FaultyStorage] = []

    def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
        self.storages.append(FaultyStorage(open_storage(url, None)))
        return CheckpointStore(self.storages[-1], config=config)


class SlowCommits(IncrementalCheckpointIO):
    """Commits (manifest writes) take a while, as on a slow disk or object store: a save is
    still in flight when Lightning's next call comes. Module level: ddp_spawn pickles it."""

    delay = 0.3

    def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
        storage = SlowStorage(open_storage(url, None), self.delay, "manifests/")
        return CheckpointStore(storage, config=config)


def test_pointer_written_at_save_and_previous_step_kept_until_commit(tmp_path: Path) -> None:
    plugin = Instrumented()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(0), path)
    plugin.wait()
    first = pointer(path)
    assert first["step"] == 0 and first["previous"] is None
    gate = plugin.storages[0].hold("manifest")
    payload = state(1)
    plugin.save_checkpoint(payload, path)  # returns while the commit is held
    payload["state_dict"]["w"].add_(1.0)  # the snapshot was taken: this is not saved
    # the path exists at once (ModelCheckpoint's version counter looks for it), naming the
    # reserved step and the step it replaces, which stays until the new one commits
    assert pointer(path)["step"] == 1
    assert (pointer(path)["previous"], pointer(path)["previous_id"]) == (0, first["id"])
    assert CheckpointStore(tmp_path / ".incremental").steps() == [0]
    gate.set()
    assert_state_equal(plugin.load_checkpoint(path), state(1))  # waits for the pending save
    assert CheckpointStore(tmp_path / ".incremental").steps() == [1]
    plugin.teardown()


@pytest.mark.parametrize("surface", ["next_save", "wait", "teardown", "trainer"])
def test_background_errors_surface(tmp_path: Path, surface: str) -> None:
    class Failing(IncrementalCheckpointIO):
        def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
            storage = FaultyStorage(open_storage(url, None))
            storage.fail("pack", times=None)
            return CheckpointStore(storage, config=config)

    plugin = Failing(max_consecutive_failures=1)  # stop at the first failed save
    path = tmp_path / "a.ckpt"
    if surface == "trainer":
        mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
        with pytest.raises(CheckpointError, match="injected fault") as info:
            trainer(tmp_path, plugin, [mc], max_steps=6).fit(net(), data())
        assert isinstance(info.value.__cause__, StorageError)
        assert not ckpt_files(tmp_path / "ckpts")
        return
    plugin.save_checkpoint(state(0), path)  # returns: the failure happens in the background
    with pytest.raises(CheckpointError, match="injected fault") as info:
        if surface == "next_save":
            plugin.save_checkpoint(state(1), tmp_path / "b.ckpt")
        elif surface == "wait":
            plugin.wait()
        else:
            plugin.teardown()
    assert isinstance(info.value.__cause__, StorageError)
    assert not path.exists()
    plugin.teardown()  # delivered once: nothing left to raise


def test_crash_between_pointer_and_commit_falls_back_loudly(tmp_path: Path) -> None:
    """The writer died after writing the pointer, before its step committed: the reader
    loads the checkpoint the file held before, with a warning naming both steps."""
    plugin, path, good = _valid_pointer(tmp_path)  # step 0, committed
    crashed = {**good, "step": 5, "id": "f" * 32, "previous": 0, "previous_id": good["id"]}
    path.write_text(json.dumps(crashed))
    reader = IncrementalCheckpointIO()  # another process: no save of its own in flight
    with pytest.warns(UserWarning, match=r"step 5 .* never committed.*step 0, instead"):
        assert_state_equal(reader.load_checkpoint(path), state(3))
    # the fallback's id is checked like the pointer's own
    path.write_text(json.dumps({**crashed, "previous_id": "0" * 32}))
    with pytest.raises(PointerError, match="copied from another checkpoint"):
        reader.load_checkpoint(path)
    # nothing to fall back to: a clear error naming the path and the step
    path.write_text(json.dumps({**crashed, "previous": None, "previous_id": None}))
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 .*never committed"):
        reader.load_checkpoint(path)
    path.write_text(json.dumps({**crashed, "previous": 3}))
    with pytest.raises(CheckpointNotFoundError, match=r"it replaced \(step 3\) is not committed"):
        reader.load_checkpoint(path)

    # the next save over the dead pointer keeps the last committed step as its previous, and
    # releases it once it commits
    path.write_text(json.dumps(crashed))
    reader.save_checkpoint(state(4), path)
    assert (pointer(path)["step"], pointer(path)["previous"]) == (6, 0)
    reader.teardown()
    assert CheckpointStore(tmp_path / ".incremental").steps() == [6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_state_equal(reader.load_checkpoint(path), state(4))
    reader.teardown()
    plugin.teardown()


@pytest.mark.parametrize("restored", [True, False])
def test_failed_background_save_leaves_the_previous_checkpoint(
    tmp_path: Path, restored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose commit fails puts the old pointer back; where that could not be done, a
    reader falls back to its ``previous``. Either way the previous checkpoint loads."""
    plugin = Instrumented(max_consecutive_failures=1)
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(0), path)
    plugin.wait()
    first = pointer(path)
    if not restored:
        monkeypatch.setattr(plugin, "_restore", lambda *args: None)
    plugin.storages[0].fail("manifest")
    plugin.save_checkpoint(state(1), path)
    with pytest.raises(CheckpointError, match="injected fault"):
        plugin.wait()
    assert CheckpointStore(tmp_path / ".incremental").steps() == [0]  # never released
    if restored:
        assert pointer(path) == first
        assert_state_equal(plugin.load_checkpoint(path), state(0))
    else:
        assert (pointer(path)["step"], pointer(path)["previous"]) == (1, 0)
        with pytest.warns(UserWarning, match="never committed"):
            assert_state_equal(plugin.load_checkpoint(path), state(0))
    plugin.remove_checkpoint(path)  # the file, and every step it kept
    plugin.teardown()
    assert not path.exists() and CheckpointStore(tmp_path / ".incremental").steps() == []


def test_copy_of_a_pending_pointer_keeps_its_fallback(tmp_path: Path) -> None:
    """Releasing a step checks the other pointer files: a pointer whose step has not
    committed keeps its ``previous`` alive."""
    plugin, path, good = _valid_pointer(tmp_path)  # a.ckpt: step 0
    shutil.copy(path, tmp_path / "b.ckpt")
    pending = {**good, "step": 9, "id": "f" * 32, "previous": 0, "previous_id": good["id"]}
    (tmp_path / "c.ckpt").write_text(json.dumps(pending))  # a writer that crashed
    plugin.remove_checkpoint(path)
    plugin.remove_checkpoint(tmp_path / "b.ckpt")
    plugin.wait()
    assert CheckpointStore(tmp_path / ".incremental").steps() == [0]
    with pytest.warns(UserWarning, match="never committed"):
        assert_state_equal(plugin.load_checkpoint(tmp_path / "c.ckpt"), state(3))
    plugin.teardown()


def test_overwrite_and_remove_release_steps_but_keep_shared_ones(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    a, b, c = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    plugin.save_checkpoint(state(0), a)
    plugin.save_checkpoint(state(1), a)  # overwrite: step 0 is released
    plugin.save_checkpoint(state(2), b)
    plugin.wait()
    store = CheckpointStore(tmp_path / ".incremental")
    assert store.steps() == [1, 2]

    shutil.copy(b, c)  # a copied pointer (ModelCheckpoint's save_last="link" fallback)
    plugin.remove_checkpoint(b)
    plugin.wait()
    assert not b.exists() and store.steps() == [1, 2]
    assert_state_equal(plugin.load_checkpoint(c), state(2))

    os.symlink("a.ckpt", tmp_path / "link.ckpt")
    plugin.remove_checkpoint(tmp_path / "link.ckpt")  # a link is only unlinked
    plugin.remove_checkpoint(c)
    plugin.remove_checkpoint(tmp_path / "never-saved.ckpt")  # no file: nothing to do
    plugin.wait()
    assert store.steps() == [1]
    assert_state_equal(plugin.load_checkpoint(a), state(1))
    plugin.teardown()
    stale = {**pointer(a), "step": 7}  # e.g. a pointer to a step deleted meanwhile
    (tmp_path / "stale.ckpt").write_text(json.dumps(stale))
    plugin.save_checkpoint(state(3), a)  # usable again after teardown
    plugin.teardown()
    assert store.steps() == [8] and pointer(a)["step"] == 8  # no step a pointer names is reused


def test_same_state_under_a_second_name_costs_only_a_manifest(tmp_path: Path) -> None:
    """ModelCheckpoint saves one global step as a top-k file and as last.ckpt."""
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(state(0), tmp_path / "epoch=0-step=0.ckpt")
    plugin.save_checkpoint(state(0), tmp_path / "last.ckpt")
    plugin.teardown()
    with CheckpointStore(tmp_path / ".incremental") as store:
        first, second = (store.manifest(s).stats for s in store.steps())
    assert first["bytes_data"] > 10_000  # 16 KiB of random float32, compressed a little
    assert second["bytes_data"] == 0 and second["chunks_reused"] == second["chunks_total"]


def test_remove_right_after_save_waits_for_that_pointer(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(0), path)
    plugin.remove_checkpoint(path)
    plugin.wait()
    assert not path.exists()
    assert CheckpointStore(tmp_path / ".incremental").steps() == []


@pytest.mark.slow  # a Python process of its own
def test_save_in_flight_when_the_script_ends_still_lands(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after ``fit`` (no teardown follows), then the script ends."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from lightning_incremental import IncrementalCheckpointIO\n"
        "io = IncrementalCheckpointIO()\n"
        "io.save_checkpoint({'global_step': 1, 'w': torch.ones(512, 512)}, sys.argv[1])\n"
    )
    root = Path(__file__).resolve().parents[2]
    path = str(tmp_path / "a.ckpt")
    subprocess.run([sys.executable, "-c", code, path], check=True, timeout=120, cwd=root)
    loaded = IncrementalCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["w"], torch.ones(512, 512))


def test_store_directory_loads_its_newest_checkpoint(tmp_path: Path) -> None:
    """A step without a file (e.g. its pointer could not be written): the store directory
    itself is a valid ckpt_path."""
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(state(0), tmp_path / "a.ckpt")
    plugin.save_checkpoint(state(1), tmp_path / "b.ckpt")
    plugin.wait()
    assert_state_equal(plugin.load_checkpoint(tmp_path / ".incremental"), state(1))


def test_pickling_for_ddp_spawn(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO(full_every=3)
    plugin.save_checkpoint(state(0), tmp_path / "a.ckpt")
    clone = pickle.loads(pickle.dumps(plugin))
    assert clone.config == plugin.config
    assert_state_equal(clone.load_checkpoint(tmp_path / "a.ckpt"), state(0))
    clone.save_checkpoint(state(1), tmp_path / "b.ckpt")
    clone.teardown()
    plugin.teardown()
    assert pointer(tmp_path / "b.ckpt")["step"] == 1


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"storage_options": "key=1"}, TypeError, "storage_options must be a dict"),
        ({"allow_pickle": "yes"}, ConfigError, "allow_pickle must be True or False"),
        ({"store_name": "../up"}, ConfigError, "store_name must be one plain directory name"),
        ({"store_name": "a/b"}, ConfigError, "store_name"),
        ({"store_name": ""}, ConfigError, "store_name"),
        ({"keep_last": 3}, ConfigError, "save_top_k"),
        ({"chunk_sise": 4096}, ConfigError, "unknown store option"),
        ({"full_every": 0}, ConfigError, "full_every must be >= 1"),
    ],
)
def test_bad_construction(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        IncrementalCheckpointIO(**kwargs)


def test_per_call_storage_options_and_bad_paths(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    t = trainer(tmp_path, plugin, max_steps=1)
    t.fit(net(), data())
    with pytest.raises(TypeError, match=r"IncrementalCheckpointIO\(storage_options=...\)"):
        t.save_checkpoint(tmp_path / "a.ckpt", storage_options={"anon": True})
    with pytest.raises(ValueError, match="inside the store directory"):
        plugin.save_checkpoint(state(), tmp_path / ".incremental" / "x.ckpt")
    with pytest.raises(TypeError, match="must be a str or path"):
        plugin.save_checkpoint(state(), 42)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    plugin.teardown()


def test_values_needing_pickle(tmp_path: Path) -> None:
    ns = argparse.Namespace(layers=2)
    path = tmp_path / "ns.ckpt"
    plugin = IncrementalCheckpointIO()
    t = trainer(tmp_path, plugin, max_steps=1)
    t.fit(net(args=ns), data())
    with pytest.raises(UnsupportedValueError) as info:
        t.save_checkpoint(path)
    message = str(info.value)
    assert "state['hyper_parameters']['args']" in message and "argparse.Namespace" in message
    assert "IncrementalCheckpointIO(allow_pickle=True)" in message
    assert not path.exists()

    trusting = IncrementalCheckpointIO(allow_pickle=True)
    t = trainer(tmp_path, trusting, max_steps=1)
    t.fit(net(args=ns), data())
    t.save_checkpoint(path)
    trusting.wait()
    assert trusting.load_checkpoint(path)["hyper_parameters"]["args"] == ns
    with pytest.raises(PickleNotAllowedError, match="weights_only=True"):
        trusting.load_checkpoint(path, weights_only=True)
    with pytest.raises(
        PickleNotAllowedError, match=r"IncrementalCheckpointIO\(allow_pickle=True\)"
    ):
        plugin.load_checkpoint(path)
    trusting.teardown()


def _valid_pointer(tmp_path: Path) -> tuple[IncrementalCheckpointIO, Path, dict[str, Any]]:
    plugin = IncrementalCheckpointIO()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(3), path)
    plugin.wait()
    return plugin, path, pointer(path)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda p: "{not json", PointerError, "not a valid pointer file"),
        (lambda p: {**p, "format": "other"}, PointerError, "not a lightning-incremental pointer"),
        (lambda p: {**p, "store": "../elsewhere"}, PointerError, "outside its own directory"),
        (lambda p: {**p, "store": "/etc"}, PointerError, "outside its own directory"),
        (lambda p: {**p, "store": "s3://bucket/x"}, PointerError, "outside its own directory"),
        (lambda p: {**p, "step": -1}, PointerError, "'step' must be an int >= 0"),
        (lambda p: {**p, "step": "0"}, PointerError, "'step' must be an int >= 0"),
        (lambda p: {**p, "global_step": 1.5}, PointerError, "'global_step' must be an int"),
        (lambda p: {**p, "version": 99}, FormatVersionError, "upgrade lightning-incremental"),
        (
            lambda p: {**p, "step": 99},
            CheckpointNotFoundError,
            "no committed checkpoint at step 99",
        ),
        (lambda p: {**p, "id": "0" * 32}, PointerError, "copied from another checkpoint"),
        (lambda p: {**p, "id": "xyz"}, PointerError, "'id' must be 32 hex digits"),
        (lambda p: {**p, "store": ".other"}, CheckpointNotFoundError, "no checkpoint store"),
        (lambda p: "{" + " " * (70 * 1024) + "}", PointerError, "larger than"),
    ],
)
def test_bad_pointer_files(tmp_path: Path, change: Any, error: Any, match: Any) -> None:
    plugin, path, good = _valid_pointer(tmp_path)
    changed = change(good)
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(error, match=match):
        plugin.load_checkpoint(path)
    plugin.teardown()


def test_empty_and_foreign_stores(tmp_path: Path) -> None:
    plugin, path, good = _valid_pointer(tmp_path)
    copy = tmp_path / "copy" / "a.ckpt"  # a pointer copied without its store
    copy.parent.mkdir()
    shutil.copy(path, copy)
    with pytest.raises(CheckpointNotFoundError, match="there is no checkpoint store"):
        plugin.load_checkpoint(copy)
    foreign = tmp_path / "other-run" / "a.ckpt"
    other = IncrementalCheckpointIO()  # another run's store: its step 0 is another checkpoint
    other.save_checkpoint(state(4), foreign.parent / "mine.ckpt")
    other.teardown()
    shutil.copy(path, foreign)
    with pytest.raises(PointerError, match="copied from another checkpoint directory"):
        plugin.load_checkpoint(foreign)

    plugin.remove_checkpoint(path)  # the store's only checkpoint: the store is now empty
    plugin.wait()
    path.write_text(json.dumps(good))  # a stale pointer into the empty store
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        plugin.load_checkpoint(path)
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        plugin.load_checkpoint(tmp_path / ".incremental")
    with pytest.raises(NotAStoreError, match="not a lightning-incremental checkpoint store"):
        plugin.load_checkpoint(tmp_path / "copy")
    t = trainer(tmp_path, plugin, max_steps=1)
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        t.fit(net(), data(), ckpt_path=tmp_path / ".incremental")
    plugin.teardown()


def test_fsspec_url_directory(tmp_path: Path) -> None:
    import fsspec

    root = f"memory://li-ckpt-io-{tmp_path.name}"
    plugin = IncrementalCheckpointIO()
    try:
        plugin.save_checkpoint(state(0), f"{root}/a.ckpt")
        plugin.save_checkpoint(state(1), f"{root}/a.ckpt")
        plugin.save_checkpoint(state(2), f"{root}/b.ckpt")
        plugin.remove_checkpoint(f"{root}/b.ckpt")
        plugin.wait()
        fs = fsspec.filesystem("memory")
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
        assert names == {"a.ckpt", ".incremental"}
        assert CheckpointStore(f"{root}/.incremental").steps() == [1]
        assert_state_equal(plugin.load_checkpoint(f"{root}/a.ckpt"), state(1))
        plugin.teardown()
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.slow
def test_ddp_spawn_two_ranks(tmp_path: Path) -> None:
    """Rank 0 saves, every rank loads; the plug-in is pickled to the spawned workers."""
    plugin = RecordingIO()
    ckpts = tmp_path / "ckpts"

    def ddp(max_steps: int) -> pl.Trainer:
        mc = ModelCheckpoint(
            dirpath=ckpts, every_n_train_steps=2, save_last=True, save_top_k=2, monitor="train_loss"
        )
        return trainer(
            tmp_path,
            plugin,
            [mc],
            max_steps=max_steps,
            strategy="ddp_spawn",
            accelerator="cpu",
            devices=2,
        )

    last = ckpts / "last.ckpt"

    def saved(global_step: int) -> bool:  # last.ckpt names it, and its step committed
        if not last.exists() or pointer(last)["global_step"] != global_step:
            return False
        with CheckpointStore(ckpts / ".incremental") as store:
            return pointer(last)["step"] in store.steps()

    fit_past_a_teardown_abort(ddp(4), net(), lambda: saved(4))
    assert pointer(last)["global_step"] == 4
    fit_past_a_teardown_abort(ddp(8), net(seed=3), lambda: saved(8), ckpt_path="last")
    assert pointer(last)["global_step"] == 8
    with CheckpointStore(ckpts / ".incremental") as store:
        assert sorted(store.steps()) == sorted(pointer(p)["step"] for p in ckpt_files(ckpts))


class _SaveTwiceThenLoad(pl.Callback):
    """On every rank at the end of fit: save, change the weights, save again to the same path,
    then load it (collective) and record what each rank got."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self.directory / "model.ckpt"
        trainer.save_checkpoint(path)
        with torch.no_grad():
            for p in pl_module.parameters():
                p.fill_(7.0)
        trainer.save_checkpoint(path)  # still committing when the load below starts
        rank = trainer.global_rank
        loaded = trainer.strategy.load_checkpoint(path)
        record = {"weight": loaded["state_dict"]["head.weight"].flatten()[0].item()}
        try:
            trainer.strategy.load_checkpoint(self.directory / "missing.ckpt")
        except FileNotFoundError as exc:
            record["error"] = str(exc)
        (self.directory / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_ddp_every_rank_loads_what_rank_0_saved_last(tmp_path: Path) -> None:
    """Only rank 0 saves, so only it knows a save is in flight: load_checkpoint is collective,
    rank 0 resolves and every rank loads the same checkpoint (or raises an error of the same
    type: a missing file is a FileNotFoundError on every rank)."""
    plugin = SlowCommits()
    plugin.delay = 1.0
    t = trainer(
        tmp_path,
        plugin,
        [_SaveTwiceThenLoad(tmp_path)],
        max_steps=2,
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
    )
    fit_past_a_teardown_abort(
        t, net(), lambda: all((tmp_path / f"rank{r}.json").exists() for r in (0, 1))
    )
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["weight"] for r in records] == [7.0, 7.0]
    assert "missing.ckpt" in records[0]["error"]
    # rank 1 raises a FileNotFoundError too, naming rank 0 and its error
    assert records[1]["error"].startswith("rank 0 could not load")
    assert records[1]["error"].endswith("FileNotFoundError: " + records[0]["error"])
    assert pointer(tmp_path / "model.ckpt")["step"] == 1


def test_unreadable_pointer_files_keep_the_step(tmp_path: Path, monkeypatch, caplog) -> None:
    """Release decides from the pointer files next to a path; when they cannot be read, the
    step another one may still name is kept, not guessed away."""
    from lightning_incremental.lightning import pointers as _pointers

    plugin = IncrementalCheckpointIO()
    a = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(0), a)
    plugin.wait()

    def unreadable(self: Any) -> list[Any]:
        raise OSError(5, "Input/output error (simulated storage fault)")

    monkeypatch.setattr(_pointers.CheckpointFile, "siblings", unreadable)
    with caplog.at_level("WARNING", logger="lightning_incremental"):
        plugin.save_checkpoint(state(1), a)  # overwrite: would release step 0
        plugin.wait()
    monkeypatch.undo()
    assert "keeping step 0" in caplog.text
    with CheckpointStore(tmp_path / ".incremental") as store:
        assert store.steps() == [0, 1]
    assert_state_equal(plugin.load_checkpoint(a), state(1))
    plugin.teardown()


def test_s3_paths_work_and_a_missing_bucket_is_not_created(s3_endpoint, s3_bucket) -> None:
    import fsspec

    options = s3_endpoint.options()
    plugin = IncrementalCheckpointIO(storage_options=options)
    path = f"s3://{s3_bucket}/ckpts/a.ckpt"
    plugin.save_checkpoint(state(0), path)
    plugin.wait()
    assert_state_equal(plugin.load_checkpoint(path), state(0))
    missing = f"{s3_bucket}-typo"
    with pytest.raises(Exception, match=missing):
        plugin.save_checkpoint(state(1), f"s3://{missing}/ckpts/a.ckpt")
        plugin.wait()
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    assert not fs.exists(missing), "a mistyped bucket must not be created"
