"""The CheckpointStore API: argument checking, step rules, async semantics, retention."""

from __future__ import annotations

import json
import os
import threading
import warnings

import pytest
import torch

from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    CorruptCheckpointError,
    NotAStoreError,
    StepError,
    StoreConfig,
    UnsupportedValueError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import LocalStorage, Storage
from tests.conftest import assert_state_equal, small_store


def make_state(seed: int = 0, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(rows, 32, generator=g), "b": torch.zeros(32)},
        "step": seed,
        "name": "run",
    }


# ---------------------------------------------------------------- bad input


def test_state_must_be_a_dict(local_url: str) -> None:
    with small_store(local_url) as store:
        for bad in ([torch.zeros(2)], torch.zeros(2), None, "state"):
            with pytest.raises(TypeError, match="state must be a dict"):
                store.save(bad, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [1.0, "3", True, None, -1])
def test_step_must_be_a_non_negative_int(local_url: str, step: object) -> None:
    with small_store(local_url) as store, pytest.raises(StepError, match="step must be"):
        store.save(make_state(), step)  # type: ignore[arg-type]


def test_steps_must_increase(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save(make_state(), 10).wait()
        with pytest.raises(StepError, match="not newer than step 10"):
            store.save(make_state(), 10)
        with pytest.raises(StepError, match="not newer than step 10"):
            store.save(make_state(), 5)
        store.save(make_state(), 11).wait()
    with small_store(local_url) as reopened, pytest.raises(StepError, match="step 11"):
        reopened.save(make_state(), 11)


def test_unsupported_value_names_its_key_path(local_url: str) -> None:
    class Custom:
        pass

    with small_store(local_url) as store:
        with pytest.raises(UnsupportedValueError, match=r"state\['opt'\]\['x'\]\[1\]"):
            store.save({"opt": {"x": [1, Custom()]}}, 1)
        # the failed save did not consume the step
        store.save({"opt": {"x": [1, 2]}}, 1).wait()
        assert store.steps() == [1]


def test_pickle_needs_opt_in_on_save_and_load(local_url: str) -> None:
    state = {"obj": range(3), "t": torch.ones(2)}
    with small_store(local_url, allow_pickle=True) as store:
        store.save(state, 1).wait()
        assert store.load()["obj"] == range(3)
    with small_store(local_url) as store, pytest.raises(CheckpointError, match="allow_pickle"):
        store.load()


def test_metadata_must_be_plain_json(local_url: str) -> None:
    with small_store(local_url) as store:
        with pytest.raises(UnsupportedValueError, match="metadata"):
            store.save(make_state(), 1, metadata={"t": torch.zeros(1)})
        with pytest.raises(TypeError, match="metadata"):
            store.save(make_state(), 1, metadata=["loss"])  # type: ignore[arg-type]
        store.save(make_state(), 1, metadata={"loss": 0.5}).wait()
    doc = json.loads(open(os.path.join(local_url, mf.manifest_path(1)), "rb").read())
    assert doc["audit"]["metadata"] == {"loss": 0.5}
    assert doc["audit"]["host"] and doc["audit"]["torch"] == torch.__version__


def test_load_from_missing_location(tmp_path) -> None:
    with CheckpointStore(str(tmp_path / "nope")) as store:
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint store"):
            store.load()
        assert store.steps() == []
    assert not (tmp_path / "nope").exists(), "reading must not create the store"


def test_load_from_a_directory_that_is_not_a_store(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.txt").write_text("x")
    with CheckpointStore(str(tmp_path / "logs")) as store:
        with pytest.raises(NotAStoreError, match="not a lightning-incremental checkpoint store"):
            store.load()
        with pytest.raises(NotAStoreError):
            store.verify()


def test_load_from_an_empty_store(local_url: str) -> None:
    os.makedirs(local_url)
    with open(os.path.join(local_url, mf.MARKER), "wb") as fh:
        fh.write(mf.marker_bytes())
    with CheckpointStore(local_url) as store:
        with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
            store.load()


def test_load_missing_step_lists_the_committed_ones(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save(make_state(), 3).wait()
        store.save(make_state(), 7).wait()
        with pytest.raises(CheckpointNotFoundError, match=r"step 5.*3, 7"):
            store.load(5)
        with pytest.raises(StepError):
            store.load("7")  # type: ignore[arg-type]


def test_unknown_protocol_and_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown storage protocol 'nosuchfs'"):
        CheckpointStore("nosuchfs://bucket/x")
    with pytest.raises(ConfigError, match="storage_options must be a dict"):
        CheckpointStore("memory://x", storage_options="key=1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="url must be"):
        CheckpointStore("")
    with pytest.raises(ConfigError, match="unknown store option"):
        CheckpointStore("memory://x", chunk_sizes=4)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("chunk_size", 1000, "multiple of 16"),
        ("chunk_size", 0, ">= 16"),
        ("full_every", 0, ">= 1"),
        ("compression_level", 0, "compression_level"),
        ("compression_level", 30, "compression_level"),
        ("max_chain_ratio", 0.5, ">= 1.0"),
        ("keep_last", 0, ">= 1"),
        ("max_in_flight", "2", "must be an int"),
        ("xor_delta", 1, "True or False"),
        ("workers", True, "must be an int"),
    ],
)
def test_config_is_validated(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig(**{option: value})
    with pytest.raises(ConfigError, match=message):
        CheckpointStore("memory://x", **{option: value})


def test_config_is_frozen() -> None:
    config = StoreConfig()
    with pytest.raises(AttributeError):
        config.chunk_size = 16  # type: ignore[misc]
    assert config.replace(chunk_size=32).chunk_size == 32


def test_closed_store_refuses_work(local_url: str) -> None:
    store = small_store(local_url)
    store.close()
    store.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        store.save(make_state(), 1)


def test_cuda_checkpoint_without_cuda_needs_map_location(local_url: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with small_store(local_url) as store:
        store.save(make_state(), 1).wait()
    path = os.path.join(local_url, mf.manifest_path(1))
    body = json.loads(open(path, "rb").read())
    body.pop("checksum")
    body["tensors"][0]["device"] = "cuda:0"
    with open(path, "wb") as fh:
        fh.write(canonical.sign(body))
    with small_store(local_url) as store:
        with pytest.raises(CheckpointError, match="map_location='cpu'"):
            store.load(1)
        state = store.load(1, map_location="cpu")
        assert state["model"]["w"].device.type == "cpu"
        seen = []
        store.load(1, map_location=lambda t, saved: seen.append(saved) or t)
        assert "cuda:0" in seen


# ---------------------------------------------------------------- semantics


def test_parameters_aliases_and_structure_round_trip(store_url: str) -> None:
    shared = torch.randn(8, 4)
    param = torch.nn.Parameter(torch.randn(3))
    state = {"a": shared, "b": shared, "p": param, "view": shared[:, 1], "nested": ({"k": 1},)}
    with small_store(store_url) as store:
        store.save(state, 1).wait()
        restored = store.load()
    assert_state_equal(restored, state)
    assert restored["a"] is restored["b"], "the same tensor twice must stay one tensor"
    assert isinstance(restored["p"], torch.nn.Parameter) and restored["p"].requires_grad


def test_mutating_after_save_does_not_change_what_is_saved(store_url: str) -> None:
    state = make_state(1)
    expected = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "step": 1,
        "name": "run",
    }
    with small_store(store_url) as store:
        handle = store.save(state, 1)
        state["model"]["w"].add_(1.0)
        state["model"]["b"].fill_(7.0)
        handle.wait()
        assert_state_equal(store.load(1), expected)


class _GatedStorage(LocalStorage):
    """Blocks every pack write until ``gate`` is set, and records when a write started."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def put(self, path, data, *, overwrite=False):  # type: ignore[no-untyped-def]
        if path.startswith("packs/"):
            self.writing.set()
            assert self.gate.wait(30), "test gate never opened"
        return super().put(path, data, overwrite=overwrite)


def test_back_pressure_bounds_saves_in_flight(local_url: str) -> None:
    storage = _GatedStorage(local_url)
    store = CheckpointStore(storage, chunk_size=4096, max_in_flight=1)
    first = store.save(make_state(1), 1)
    assert storage.writing.wait(30)
    second_returned = threading.Event()

    def second() -> None:
        store.save(make_state(2), 2)
        second_returned.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_returned.wait(0.5), "save must block while max_in_flight saves are pending"
    assert not first.done()
    storage.gate.set()
    thread.join(30)
    assert second_returned.is_set()
    results = store.wait()
    assert [r.step for r in results][-1] == 2
    store.close()
    assert first.wait().step == 1


class _FailingStorage(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fail = True

    def put(self, path, data, *, overwrite=False):  # type: ignore[no-untyped-def]
        if self.fail and path.startswith("packs/"):
            raise OSError(28, "No space left on device")
        return super().put(path, data, overwrite=overwrite)


def test_background_error_is_raised_by_wait_once(local_url: str) -> None:
    storage = _FailingStorage(local_url)
    store = CheckpointStore(storage, chunk_size=4096)
    handle = store.save(make_state(), 1)
    with pytest.raises(OSError, match="No space"):
        handle.wait()
    storage.fail = False
    store.save(make_state(), 1).wait()  # delivered errors are not raised again
    store.close()
    assert store.steps() == [1]


def test_background_error_is_raised_by_next_save_or_close(local_url: str) -> None:
    storage = _FailingStorage(local_url)
    store = CheckpointStore(storage, chunk_size=4096)
    store.save(make_state(), 1)
    with pytest.raises(OSError, match="No space"):
        store.save(make_state(), 2)  # the first save's error; waits for it by back-pressure
    storage.fail = False
    store.save(make_state(), 2).wait()
    storage.fail = True
    store.save(make_state(3), 3)
    with pytest.raises(OSError, match="No space"):
        store.close()
    reopened = CheckpointStore(local_url)
    assert reopened.steps() == [2]
    reopened.close()


def test_keep_last_retention_keeps_what_is_needed(local_url: str) -> None:
    state = make_state(0, rows=512)
    saved = {}
    with small_store(local_url, keep_last=2, full_every=3, min_object_age_s=0) as store:
        for step in range(1, 8):
            state["model"]["w"][step * 8 : step * 8 + 4] += 1.0
            state["step"] = step
            store.save(state, step).wait()
            saved[step] = {
                "model": {k: v.clone() for k, v in state["model"].items()},
                "step": step,
                "name": "run",
            }
            assert store.steps() == list(range(max(1, step - 1), step + 1))
        for step in store.steps():
            assert_state_equal(store.load(step), saved[step])
            assert store.verify(step).ok
        with pytest.raises(CheckpointNotFoundError):
            store.load(1)
    live = set()
    with small_store(local_url) as store:
        for step in store.steps():
            live |= set(store.manifest(step).packs)
    on_disk = {p for p in LocalStorage(local_url).list("packs")}
    assert on_disk == live, "retention must delete every pack no kept checkpoint needs"


def test_gc_dry_run_and_grace(local_url: str) -> None:
    with small_store(local_url, full_every=1, min_object_age_s=0) as store:
        for step in range(3):
            store.save(make_state(step), step).wait()
        report = store.gc(keep_last=1, dry_run=True)
        assert report.removed_steps == [0, 1] and report.removed_objects
        assert store.steps() == [0, 1, 2]
        report = store.gc(keep_last=1, grace_s=3600)
        assert store.steps() == [2] and report.removed_objects == []
        report = store.gc()
        assert report.removed_objects and report.bytes_freed > 0
        assert_state_equal(store.load(), make_state(2))
        with pytest.raises(ConfigError):
            store.gc(keep_last=0)


def test_reopened_store_writes_deltas_after_load(local_url: str) -> None:
    state = make_state(0, rows=2048)
    with small_store(local_url) as store:
        store.save(state, 1).wait()
    with small_store(local_url) as store:
        restored = store.load()
        restored["model"]["w"].mul_(1.0001)
        result = store.save(restored, 2).wait()
        assert result.chunks_delta > 0, "the loaded checkpoint must serve as XOR base"
        assert_state_equal(store.load(2)["model"], restored["model"])


def test_fallback_then_new_history_moves_corrupt_checkpoint_aside(local_url: str) -> None:
    with small_store(local_url, full_every=1) as store:
        store.save(make_state(1), 10).wait()
        store.save(make_state(2), 20).wait()
    manifest = os.path.join(local_url, mf.manifest_path(20))
    doc = json.loads(open(manifest, "rb").read())
    for pack in doc["packs"]:
        if (
            pack
            not in json.loads(open(os.path.join(local_url, mf.manifest_path(10)), "rb").read())[
                "packs"
            ]
        ):
            os.remove(os.path.join(local_url, pack))
    with small_store(local_url) as store:
        with pytest.warns(UserWarning, match="step 20.*missing"):
            restored = store.load()
        assert_state_equal(restored, make_state(1))
        with pytest.raises(CorruptCheckpointError):
            store.load(20)
        store.save(make_state(3), 15).wait()
        assert store.steps() == [10, 15]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_state_equal(store.load(), make_state(3))
    assert os.path.exists(os.path.join(local_url, "quarantine", f"{20:020d}.json"))


def test_verify_reports_every_object(store_url: str) -> None:
    with small_store(store_url) as store:
        store.save(make_state(0, rows=512), 1).wait()
        report = store.verify()
        assert report.ok and report.step == 1
        assert len(report.objects) >= 2 and all(o.ok for o in report.objects)
        assert report.chunks_checked >= 512 * 32 * 4 // 4096


def test_custom_storage_must_implement_the_interface() -> None:
    with pytest.raises(TypeError):
        Storage()  # type: ignore[abstract]


def test_changing_chunk_size_between_sessions_stays_exact(local_url: str) -> None:
    state = make_state(0, rows=2048)
    with small_store(local_url, chunk_size=4096) as store:
        store.save(state, 1).wait()
    with small_store(local_url, chunk_size=1024) as store:
        restored = store.load()
        restored["model"]["w"][:100].mul_(1.001)
        result = store.save(restored, 2).wait()
        assert result.chunks_delta == 0, "no XOR across different chunkings"
        assert_state_equal(store.load(2), restored)
        assert store.verify(2).ok


def test_delete_one_checkpoint_keeps_the_others_exact(local_url: str) -> None:
    state = make_state(0, rows=1024)
    saved = {}
    with small_store(local_url) as store:
        for step in (1, 2, 3, 4):
            state["model"]["w"][step * 10 : step * 10 + 3] += 1.0
            store.save(state, step).wait()
            saved[step] = {
                "model": {k: v.clone() for k, v in state["model"].items()},
                "step": 0,
                "name": "run",
            }
        store.delete(2)
        store.delete(4)  # the newest: the next save still builds on it
        with pytest.raises(CheckpointNotFoundError, match="step 4"):
            store.delete(4)
        assert store.steps() == [1, 3]
        state["model"]["w"][60:63] += 1.0
        store.save(state, 5).wait()
        saved[5] = {
            "model": {k: v.clone() for k, v in state["model"].items()},
            "step": 0,
            "name": "run",
        }
    with small_store(local_url) as store:
        for step in (1, 3, 5):
            assert_state_equal(store.load(step), saved[step])
            assert store.verify(step).ok
        store.delete(5)
        store.gc()
        assert_state_equal(store.load(), saved[3])


def test_a_save_pending_at_interpreter_exit_commits(tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from lightning_incremental.core import CheckpointStore\n"
        f"store = CheckpointStore({str(tmp_path / 's')!r})\n"
        "store.save({'w': torch.arange(1_000_000, dtype=torch.float32)}, 7)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stderr
    with CheckpointStore(str(tmp_path / "s")) as store:
        assert torch.equal(store.load(7)["w"], torch.arange(1_000_000, dtype=torch.float32))


def test_state_dict_metadata_survives(store_url: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    state = {"model": model.state_dict()}
    with small_store(store_url) as store:
        store.save(state, 1).wait()
        restored = store.load(1)["model"]
    assert restored._metadata == state["model"]._metadata
    assert restored._metadata["1"]["version"] == 2
    torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).load_state_dict(restored)


def test_done_callbacks_run_once_with_the_outcome(local_url: str) -> None:
    seen: list[tuple[int, bool]] = []
    with small_store(local_url) as store:
        handle = store.save(make_state(), 1)
        handle.add_done_callback(lambda h: seen.append((h.step, h.exception() is None)))
        handle.wait()
        handle.add_done_callback(lambda h: seen.append((h.step, True)))
    assert seen == [(1, True), (1, True)]


def test_loaded_step_world_size_and_resaving_a_corrupt_step(local_url: str) -> None:
    with small_store(local_url, full_every=1) as store:
        for step in (3, 6, 9):
            store.save(make_state(step), step, world_size=2).wait()
        with pytest.raises(ConfigError, match="world_size"):
            store.save(make_state(), 10, world_size=0)
    newest = json.loads(open(os.path.join(local_url, mf.manifest_path(9)), "rb").read())
    assert newest["audit"]["world_size"] == 2
    older = json.loads(open(os.path.join(local_url, mf.manifest_path(6)), "rb").read())["packs"]
    for pack in set(newest["packs"]) - set(older):
        os.remove(os.path.join(local_url, pack))
    with small_store(local_url) as store:
        assert store.loaded_step is None
        with pytest.raises(CorruptCheckpointError):
            store.load(9)
        assert_state_equal(store.load(6), make_state(6))
        assert store.loaded_step == 6
        store.save(make_state(7), 9).wait()  # the corrupt step 9 is replaced, not a StepError
        assert_state_equal(store.load(), make_state(7))
        assert store.loaded_step == 9


def test_audit_records_the_code_commit_of_the_working_directory(tmp_path, monkeypatch) -> None:
    from lightning_incremental.core.format.layout import code_version

    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "refs" / "heads" / "main").write_text("ab" * 20 + "\n")
    (repo / "sub").mkdir()
    monkeypatch.chdir(repo / "sub")
    code_version.cache_clear()
    try:
        with small_store(str(tmp_path / "s")) as store:
            store.save(make_state(), 1).wait()
            assert store.manifest(1).audit["code_commit"] == "ab" * 20
        monkeypatch.chdir(tmp_path)
        code_version.cache_clear()
        assert code_version() is None
    finally:
        code_version.cache_clear()


def test_deleting_the_newest_steps_lets_them_be_saved_again(local_url: str) -> None:
    state = make_state(0, rows=256)
    with small_store(local_url) as store:
        for step in (2, 4, 6):
            state["model"]["w"][step : step + 2] += 1.0
            store.save(state, step).wait()
        store.delete(6)
        store.delete(4)
        state["model"]["w"][0:2] += 5.0
        store.save(state, 4).wait()  # a run resumed from step 2 saves step 4 again
        expected = {k: v.clone() for k, v in state["model"].items()}
        with pytest.raises(StepError, match="not newer than step 4"):
            store.save(state, 3)
        store.delete(2)  # an older step: the newest stays the bound
        with pytest.raises(StepError, match="not newer than step 4"):
            store.save(state, 4)
    with small_store(local_url) as store:
        assert store.steps() == [4]
        assert_state_equal(store.load(4)["model"], expected)
        assert store.verify(4).ok
