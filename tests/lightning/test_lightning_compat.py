"""Lightning's everyday checkpoint patterns with IncrementalCheckpointIO, modelled on Lightning's
own checkpoint tests: a second Trainer in the same process loading what the first just saved
(``fit/validate/test/predict(ckpt_path=...)``), ``map_location`` side by side with
``torch.load``, no thread left behind, ``load_from_checkpoint`` and plain ``.ckpt`` files."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.saving import _default_map_location

import lightning_incremental as li
from lightning_incremental import IncrementalCheckpointIO
from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    PickleNotAllowedError,
    StorageError,
    StoreConfig,
)
from lightning_incremental.core.save import inflight
from lightning_incremental.core.storage import open_storage
from lightning_incremental.core.workers import WorkerPool
from lightning_incremental.lightning.pointers import HEADER, NotATorchCheckpointError, document
from tests.conftest import assert_state_equal, dead_pid
from tests.faulty import FaultyStorage
from tests.lightning.test_checkpoint_io import (
    STEPS_PER_EPOCH,
    Net,
    RecordingIO,
    SlowCommits,
    ckpt_files,
    data,
    net,
    pointer,
    state,
    trainer,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*weights_only.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*:UserWarning"),
]


class Gated(IncrementalCheckpointIO):
    """Commits (manifest writes) wait for a gate the test opens: a save is in flight, for as
    long as the test wants, whichever plug-in instance or thread looks at it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hold = False
        self.gates: list[threading.Event] = []

    def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
        storage = FaultyStorage(open_storage(url, None))
        if self.hold:
            self.gates.append(storage.hold("manifest"))
        return CheckpointStore(storage, config=config)


class SaveAtFitEnd(pl.Callback):
    """``trainer.save_checkpoint`` in ``on_fit_end``: the trainer is still running, so the save
    is asynchronous, and it is still in flight when ``fit`` returns."""

    def __init__(self, path: Path, plugin: Gated) -> None:
        self.path = path
        self.plugin = plugin

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plugin.hold = True
        trainer.save_checkpoint(self.path)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _li_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("li-")}


def _release_when_a_load_waits(
    monkeypatch: pytest.MonkeyPatch, gates: list[threading.Event]
) -> threading.Thread:
    """Open ``gates`` once a load in this process is waiting for an in-flight save (not before:
    the load must find the save in flight)."""
    waiting = threading.Event()
    real_wait = inflight.wait

    def spy(url: Any, timeout: float | None = None) -> bool:
        if inflight.pending(url):
            waiting.set()
        return real_wait(url, timeout)

    monkeypatch.setattr(inflight, "wait", spy)

    def release() -> None:
        waiting.wait(120)
        for gate in gates:
            gate.set()

    opener = threading.Thread(target=release, daemon=True)
    opener.start()
    return opener


# ---------------------------------------------------------------------- a second Trainer


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_second_trainer_loads_what_the_first_just_saved(tmp_path: Path, fn: str) -> None:
    """``t1.fit(); t1.save_checkpoint(p)``, then a new Trainer with a new plug-in instance
    runs ``fn(ckpt_path=p)`` (Lightning's test_restore_callbacks_in_non_fit_phases,
    test_strict_loading): the save committed before ``save_checkpoint`` returned."""
    first = SlowCommits()
    trained = net()
    t1 = trainer(tmp_path, first, max_steps=3)
    t1.fit(trained, data())
    path = tmp_path / "model.ckpt"
    t1.save_checkpoint(path)  # outside a stage: returns once committed
    with CheckpointStore(tmp_path / ".incremental") as store:
        assert pointer(path)["step"] in store.steps()
    expected = _weights(trained)

    model = net(seed=7)
    t2 = trainer(tmp_path, SlowCommits(), max_steps=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(never committed|not committed).*")
        getattr(t2, fn)(model, data(), ckpt_path=path)
    if fn == "fit":
        assert t2.global_step == 5  # resumed at step 3
    else:
        assert_state_equal(_weights(model), expected)


@pytest.mark.parametrize("fn", ["fit", "validate"])
def test_load_waits_for_a_save_in_flight_in_another_plugin_instance(
    tmp_path: Path, fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save still in flight (made in on_fit_end, while the trainer runs) is waited for by a
    second Trainer's plug-in: it loads that checkpoint, not an error or an older one."""
    path = tmp_path / "end.ckpt"
    first = Gated()
    trained = net()
    trainer(tmp_path, first, [SaveAtFitEnd(path, first)], max_steps=3).fit(trained, data())
    assert first.gates and not first.gates[0].is_set()  # the commit is held: in flight
    with CheckpointStore(tmp_path / ".incremental") as store:
        assert pointer(path)["step"] not in store.steps()
    expected = _weights(trained)

    opener = _release_when_a_load_waits(monkeypatch, first.gates)
    model = net(seed=7)
    t2 = trainer(tmp_path, IncrementalCheckpointIO(), max_steps=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(never committed|not committed).*")
        getattr(t2, fn)(model, data(), ckpt_path=path)
    opener.join(10)
    if fn == "fit":
        assert t2.global_step == 5
    else:
        assert_state_equal(_weights(model), expected)
    first.wait()


def test_store_load_waits_for_another_instance_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FaultyStorage(open_storage(str(tmp_path / "s"), None))
    gate = storage.hold("manifest")
    writer = CheckpointStore(storage)
    handle = writer.save({"w": torch.arange(4.0)}, 3)
    opener = _release_when_a_load_waits(monkeypatch, [gate])
    with CheckpointStore(tmp_path / "s") as reader:  # another instance, same location
        assert torch.equal(reader.load(3)["w"], torch.arange(4.0))
    opener.join(10)
    handle.wait()
    writer.close()


def test_save_checkpoint_outside_a_stage_raises_a_failed_commit(tmp_path: Path) -> None:
    class Failing(IncrementalCheckpointIO):
        def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
            storage = FaultyStorage(open_storage(url, None))
            storage.fail("manifest", times=None)
            return CheckpointStore(storage, config=config)

    baseline = set(threading.enumerate())
    model = net()
    t = trainer(tmp_path, Failing(), max_steps=1)
    t.fit(model, data())
    with pytest.raises(StorageError, match=r"model\.ckpt .*did not commit.*injected fault"):
        t.save_checkpoint(tmp_path / "model.ckpt")
    assert not (tmp_path / "model.ckpt").exists()
    assert set(threading.enumerate()) <= baseline  # none of its threads left


def _pointer_by(
    tmp_path: Path, writer: dict[str, Any] | None
) -> tuple[Path, IncrementalCheckpointIO]:
    """A pointer file naming a step that never committed, written by ``writer``."""
    plugin = IncrementalCheckpointIO()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(0), path)
    plugin.close()
    body = pointer(path)
    body.update(step=body["step"] + 5, id="f" * 32, previous=None, previous_id=None)
    body["writer"] = writer
    import json

    path.write_bytes(HEADER + json.dumps(body).encode())
    return path, IncrementalCheckpointIO()


def test_uncommitted_pointer_says_whether_its_writer_is_alive(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        cases = [
            (
                {"host": host, "pid": sleeper.pid},
                rf"is not committed yet: its writer, process "
                rf"{sleeper.pid} on .*is still running",
            ),
            (
                {"host": host, "pid": dead},
                rf"never committed: its writer died \(process "
                rf"{dead} on .*exited before",
            ),
            (
                {"host": host, "pid": os.getpid()},
                "never committed: this process wrote the file, so either its save failed",
            ),
            ({"host": host + "-elsewhere", "pid": 1}, "this host cannot tell which"),
            (None, "never committed .*the process saving it crashed"),  # an older pointer
        ]
        for writer, match in cases:
            path, reader = _pointer_by(tmp_path, writer)
            with pytest.raises(CheckpointNotFoundError, match=match):
                reader.load_checkpoint(path)
            reader.close()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------------- map_location


def _saved_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "state_dict": {
            "w": torch.randn(8, 4),
            "p": torch.nn.Parameter(torch.randn(3)),
            "i": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(2, 2).to(torch.bfloat16),
            "b": torch.tensor([True, False]),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5),
        },
        "epoch": 1,
    }


MAP_LOCATIONS: list[Any] = [
    None,
    "cpu",
    torch.device("cpu"),
    {"cpu": "cpu"},
    {"cuda:0": "cpu"},
    lambda storage, loc: None,
    lambda storage, loc: storage,
    lambda storage, loc: storage.cpu(),
    _default_map_location,
    "meta",
    {"cpu": "meta"},
]


def _id(map_location: Any) -> str:
    """A stable test id (a function's repr names its address, which differs between the
    processes pytest-xdist collects in)."""
    if callable(map_location):
        return getattr(map_location, "__name__", "callable")
    return repr(map_location)[:30]


@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=_id)
def test_map_location_behaves_as_torch_load(tmp_path: Path, map_location: Any) -> None:
    saved = _saved_state()
    torch.save(saved, tmp_path / "plain.ckpt")
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(saved, tmp_path / "inc.ckpt")
    plugin.wait()
    expected = torch.load(tmp_path / "plain.ckpt", map_location=map_location, weights_only=True)
    got = plugin.load_checkpoint(tmp_path / "inc.ckpt", map_location=map_location)
    with CheckpointStore(tmp_path / ".incremental") as store:
        engine = store.load(map_location=map_location)
    for actual in (got, engine):
        for key, want in expected["state_dict"].items():
            have = actual["state_dict"][key]
            assert type(have) is type(want), key
            assert (have.device, have.dtype, have.shape) == (want.device, want.dtype, want.shape)
            assert have.requires_grad == want.requires_grad, key
            if want.device.type != "meta":
                assert torch.equal(have, want), key
    plugin.teardown()


def test_map_location_callable_sees_what_torch_load_gives_it(tmp_path: Path) -> None:
    saved = _saved_state()
    torch.save(saved, tmp_path / "plain.ckpt")
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(saved, tmp_path / "inc.ckpt")
    plugin.wait()
    seen: dict[str, set[Any]] = {"torch": set(), "ours": set()}

    def recorder(which: str) -> Any:
        def record(storage: Any, location: str) -> None:
            seen[which].add((type(storage), storage.device.type, location))
            return None

        return record

    torch.load(tmp_path / "plain.ckpt", map_location=recorder("torch"), weights_only=True)
    plugin.load_checkpoint(tmp_path / "inc.ckpt", map_location=recorder("ours"))
    assert seen["ours"] == seen["torch"] == {(torch.UntypedStorage, "cpu", "cpu")}
    # the issue this guards: a callable returning None used to make every tensor None
    loaded = plugin.load_checkpoint(tmp_path / "inc.ckpt", map_location=lambda s, loc: None)
    assert_state_equal(loaded["state_dict"], saved["state_dict"])
    with pytest.raises(ConfigError, match="must return a storage"):
        plugin.load_checkpoint(tmp_path / "inc.ckpt", map_location=lambda s, loc: 5)
    plugin.teardown()


def test_default_map_location_is_torch_checkpoint_io_s(tmp_path: Path) -> None:
    """Not given: every tensor on the CPU (TorchCheckpointIO's default); None: torch.load's
    None, the saved device — a saved CUDA tensor then needs CUDA, as with torch.load."""
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(_saved_state(), tmp_path / "inc.ckpt")
    plugin.wait()
    assert plugin.load_checkpoint(tmp_path / "inc.ckpt")["state_dict"]["w"].device.type == "cpu"
    plugin.teardown()


# ---------------------------------------------------------------------- threads


def test_no_thread_outlives_save_checkpoint_outside_a_stage_or_fit(tmp_path: Path) -> None:
    baseline = set(threading.enumerate())  # (idle threads of earlier tests may still end)
    plugin = IncrementalCheckpointIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True)
    t = trainer(tmp_path, plugin, [mc], max_steps=STEPS_PER_EPOCH)
    t.fit(net(), data())
    assert set(threading.enumerate()) <= baseline
    for i in range(3):
        t.save_checkpoint(tmp_path / f"after-{i}.ckpt")
        assert set(threading.enumerate()) <= baseline
    t2 = trainer(tmp_path, IncrementalCheckpointIO(), max_steps=2 * STEPS_PER_EPOCH)
    t2.validate(net(seed=3), data(), ckpt_path=tmp_path / "after-2.ckpt")
    assert set(threading.enumerate()) <= baseline


def test_idle_threads_end_and_close_ends_them_at_once(tmp_path: Path) -> None:
    """A direct save (asynchronous) leaves threads only while there is work: they end after
    a short idle time; close() ends them at once."""
    baseline = _li_threads()
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint(state(0), tmp_path / "a.ckpt")
    assert _li_threads() - baseline  # working
    plugin.close()
    assert _li_threads() <= baseline

    pool = WorkerPool(2, "li-test-pool", idle_s=0.05)
    assert pool.submit(lambda: 7).result() == 7
    threads = pool.threads()
    assert threads and all(t.daemon and t.name.startswith("li-test-pool_") for t in threads)
    for thread in threads:
        thread.join(60)  # ends by itself, idle
        assert not thread.is_alive()
    assert pool.submit(lambda: 8).result() == 8  # started again on demand
    (thread,) = pool.threads()
    thread.stop()  # as harnesses that end left-over daemon threads do
    assert not thread.is_alive() and not pool.threads()
    assert pool.submit(lambda: 10).result() == 10
    pool.shutdown()
    assert not pool.threads()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 9)


def test_dropped_store_threads_end_when_idle(tmp_path: Path) -> None:
    baseline = _li_threads()
    with CheckpointStore(tmp_path / "s") as store:
        store.save({"w": torch.ones(3)}, 0).wait()
    assert _li_threads() <= baseline
    store = CheckpointStore(tmp_path / "s", workers=2)
    store.save({"w": torch.full((3,), 2.0)}, 1).wait()  # new bytes: a pack is written
    workers = store._pool.threads() + store._queue.threads() + store._engine.writer.threads()
    assert store._engine.writer.threads(), "packs are written on writer threads of their own"
    assert workers and all(t.daemon for t in workers)
    for thread in workers:  # nobody closed the store: the threads end when idle
        thread.join(60)
        assert not thread.is_alive()
    store.close()


# ---------------------------------------------------------------------- load_from_checkpoint


def _fit_with_best(tmp_path: Path, plugin: IncrementalCheckpointIO | None) -> ModelCheckpoint:
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        monitor="val_loss",
        save_top_k=2,
        save_last=True,
        every_n_epochs=1,
    )
    trainer(tmp_path, plugin, [mc], max_epochs=3).fit(net(lr=0.02, width_note="x"), data(), data())
    return mc


def test_load_from_checkpoint_of_best_model_path(tmp_path: Path) -> None:
    mc = _fit_with_best(tmp_path, IncrementalCheckpointIO())
    best = mc.best_model_path
    # Lightning's own load_from_checkpoint reads the file with torch.load: it fails, saying
    # what the file is and how to load it
    with pytest.raises(Exception, match="lightning_incremental"):
        Net.load_from_checkpoint(best)
    with pytest.raises(NotATorchCheckpointError, match=r"lightning_incremental\.load_from_ch"):
        torch.load(best, weights_only=False)
    assert Path(best).read_bytes().startswith(b"clightning_incremental._pointers\n")

    model = li.load_from_checkpoint(Net, best)
    assert isinstance(model, Net)
    assert model.hparams["lr"] == 0.02 and model.hparams["width_note"] == "x"
    expected = dict(IncrementalCheckpointIO().load_checkpoint(best)["state_dict"])
    assert_state_equal(_weights(model), expected)
    # the same arguments as Lightning's: hyper-parameter overrides, map_location, strict
    override = li.load_from_checkpoint(Net, best, map_location="cpu", lr=0.5)
    assert override.hparams["lr"] == 0.5
    assert_state_equal(_weights(override), expected)
    with pytest.raises(TypeError, match="LightningModule or LightningDataModule class"):
        li.load_from_checkpoint(model, best)  # type: ignore[arg-type]


def test_load_from_checkpoint_matches_lightning_on_plain_files(tmp_path: Path) -> None:
    """On a plain torch.save checkpoint the helper returns what Lightning's returns."""
    mc = _fit_with_best(tmp_path, None)
    ours = li.load_from_checkpoint(Net, mc.best_model_path, lr=0.3)
    theirs = Net.load_from_checkpoint(mc.best_model_path, lr=0.3)
    assert dict(ours.hparams) == dict(theirs.hparams)
    assert_state_equal(_weights(ours), _weights(theirs))


def test_load_from_checkpoint_strict_and_pickles(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO(allow_pickle=True)
    model = net()
    model.hparams["ns"] = io.StringIO  # a value only pickle can hold (a class)
    t = trainer(tmp_path, plugin, max_steps=1)
    t.fit(model, data())
    path = tmp_path / "m.ckpt"
    t.save_checkpoint(path)
    with pytest.raises(PickleNotAllowedError, match="weights_only=False"):
        li.load_from_checkpoint(Net, path)
    assert li.load_from_checkpoint(Net, path, weights_only=False).hparams["ns"] is io.StringIO

    class Wider(Net):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="Missing key"):
        li.load_from_checkpoint(Wider, path, weights_only=False)
    loose = li.load_from_checkpoint(Wider, path, weights_only=False, strict=False)
    assert_state_equal(_weights(loose.head), _weights(model.head))


class DataModule(pl.LightningDataModule):
    def __init__(self, batch: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen = 0

    def train_dataloader(self) -> Any:
        return data()

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 11}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = state_dict["seen"]


def test_load_from_checkpoint_of_a_datamodule(tmp_path: Path) -> None:
    t = trainer(tmp_path, IncrementalCheckpointIO(), max_steps=1)
    t.fit(net(), datamodule=DataModule(batch=6))
    t.save_checkpoint(tmp_path / "dm.ckpt")
    dm = li.load_from_checkpoint(DataModule, tmp_path / "dm.ckpt")
    assert dm.hparams["batch"] == 6 and dm.seen == 11


# ---------------------------------------------------------------------- plain files (materialize)


@pytest.mark.parametrize("materialize", [True, "best", "last"])
def test_materialize_writes_plain_best_and_last_files(tmp_path: Path, materialize: Any) -> None:
    plugin = RecordingIO(materialize=materialize)
    mc = _fit_with_best(tmp_path, plugin)
    kinds = {"best", "last"} if materialize is True else {materialize}
    plain = {mc.best_model_path} if "best" in kinds else set()
    if "last" in kinds:
        plain.add(mc.last_model_path)
    for path in ckpt_files(tmp_path / "ckpts"):
        head = Path(path).read_bytes()[:64]
        if path in plain:  # a real torch.save file, holding exactly what Lightning saved
            assert not head.startswith(HEADER[:16])
            loaded = torch.load(path, weights_only=True)
            assert_state_equal(loaded["state_dict"], plugin.expected(path)["state_dict"])
            assert loaded["global_step"] == plugin.expected(path)["global_step"]
        else:
            assert head.startswith(HEADER[:16])
    # the store keeps exactly the steps that pointer files still name
    with CheckpointStore(tmp_path / "ckpts" / ".incremental") as store:
        named = sorted(pointer(p)["step"] for p in ckpt_files(tmp_path / "ckpts") - plain)
        assert sorted(store.steps()) == named
    # Lightning's own tools read them; the plug-in too; a resumed run goes on from last
    if "best" in kinds:
        assert isinstance(Net.load_from_checkpoint(mc.best_model_path), Net)
    t = trainer(tmp_path, IncrementalCheckpointIO(), max_epochs=4)
    t.fit(net(seed=2), data(), data(), ckpt_path=mc.last_model_path)
    assert t.current_epoch == 4


def test_materialize_follows_a_last_link(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO(materialize="last")
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", save_top_k=1, every_n_train_steps=4, save_last="link"
    )
    trainer(tmp_path, plugin, [mc], max_steps=STEPS_PER_EPOCH).fit(net(), data())
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink()
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    with CheckpointStore(tmp_path / "ckpts" / ".incremental") as store:
        assert store.steps() == []


def test_bad_materialize_option() -> None:
    with pytest.raises(ConfigError, match="materialize must be"):
        IncrementalCheckpointIO(materialize="worst")


# ---------------------------------------------------------------------- pointer files


def test_old_pointer_files_without_header_still_load(tmp_path: Path) -> None:
    plugin = IncrementalCheckpointIO()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(1), path)
    plugin.close()
    data_ = path.read_bytes()
    assert data_.startswith(HEADER) and document(data_).startswith(b"{")
    path.write_bytes(document(data_))  # as an earlier version wrote it: JSON only
    assert_state_equal(IncrementalCheckpointIO().load_checkpoint(path), state(1))
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(HEADER[:100])
    with pytest.raises(CheckpointError, match="header is cut off"):
        IncrementalCheckpointIO().load_checkpoint(cut)


def test_the_pointer_header_names_the_module_every_version_wrote(tmp_path: Path) -> None:
    """The header's pickle names ``lightning_incremental._pointers`` whatever module holds the
    code: a pointer file written by any version is recognised, and ``torch.load`` of one with
    ``weights_only=False`` still raises the error that says how to load it."""
    assert HEADER.startswith(b"clightning_incremental._pointers\nnot_a_torch_checkpoint\n")
    plugin = IncrementalCheckpointIO()
    path = tmp_path / "a.ckpt"
    plugin.save_checkpoint(state(1), path)
    plugin.close()
    with pytest.raises(NotATorchCheckpointError, match="pointer file"):
        torch.load(path, weights_only=False)
    assert_state_equal(IncrementalCheckpointIO().load_checkpoint(path), state(1))


def test_lightning_versions_outside_the_supported_range_are_named() -> None:
    from lightning_incremental.lightning import compat as _compat

    assert _compat.parse_version("2.6.1") == (2, 6)
    assert _compat.parse_version("2.7.0rc1") == (2, 7)
    assert _compat.parse_version("3") == (3, 0)
    assert _compat.parse_version("2.5.1.post0") == (2, 5)
    assert _compat.parse_version(_compat.LIGHTNING_VERSION) >= _compat.OLDEST_SUPPORTED
    with pytest.raises(ImportError, match=r"lightning>=2\.5, found 2\.4\.0: pip install -U"):
        _compat.check_version("2.4.0")
    with pytest.warns(UserWarning, match=r"tested with Lightning up to 2\.6\.x, found 2\.7\.0"):
        _compat.check_version("2.7.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_version("2.5.0")
        _compat.check_version("2.6.9")


def test_lightnings_signal_handlers_without_collectives(tmp_path: Path) -> None:
    """What the callback's handler calls in place of Lightning's, under SLURM auto-requeue:
    the launcher forwards the first SIGTERM only; no broadcast (the notifier is not called), no
    checkpoint and no requeue inside the handler (the SLURM handler is dropped); Lightning's
    ``received_sigterm`` stays unset until the ranks agree; a user's handler still runs."""
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_incremental.lightning import compat as _compat

    user: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, lambda signum, frame: user.append(signum))
    trainer = pl.Trainer(
        default_root_dir=tmp_path, logger=False, enable_progress_bar=False, accelerator="cpu"
    )
    trainer._accelerator_connector.cluster_environment = SLURMEnvironment(auto_requeue=True)
    assert _compat.slurm_auto_requeue(trainer)
    connector = trainer._signal_connector
    try:
        connector.register_signal_handlers()
        kills: list[int] = []

        class Launcher:
            def kill(self, signum: int) -> None:
                kills.append(signum)

        trainer.strategy._launcher = Launcher()  # type: ignore[assignment]
        trainer.save_checkpoint = lambda *a, **k: pytest.fail("a save inside a handler")  # type: ignore[method-assign]
        term = _compat.signal_handler_without_collectives(trainer, signal.getsignal(signal.SIGTERM))
        usr = _compat.signal_handler_without_collectives(trainer, signal.getsignal(signal.SIGUSR1))
        for _ in range(3):
            term(signal.SIGTERM, None)
            usr(signal.SIGUSR1, None)
        assert kills == [signal.SIGTERM], "forwarded once, as Lightning does"
        assert user == [signal.SIGTERM] * 3, "the user's handler Lightning composed still runs"
        assert not trainer.received_sigterm
        plain = signal.default_int_handler
        assert _compat.signal_handler_without_collectives(trainer, plain) is plain
    finally:
        connector.teardown()
        for signum, handler in before.items():
            signal.signal(signum, handler)
