"""IncrementalCheckpointIO where Lightning's own checkpoint IO behaves differently: what
``ddp_spawn``'s launching process leaves (threads, the writer lease, the temporary store),
removing a checkpoint that was just loaded, ``http(s)://`` paths, and ``AsyncCheckpointIO``."""

from __future__ import annotations

import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_incremental
from lightning_incremental import IncrementalCheckpointIO
from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit.lease import newest
from lightning_incremental.core.storage import open_storage
from tests.conftest import assert_state_equal
from tests.lightning.test_checkpoint_io import Net, data, net, state, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*weights_only.*:UserWarning"),
]


_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_before() -> None:
    """Threads of ours that earlier tests of this process left are not this test's."""
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def our_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("li-") and t.is_alive() and t not in _BEFORE
    ]


def worker_save(path: Path, checkpoint: dict[str, object]) -> None:
    """What ddp_spawn's rank 0 does: a save outside of ``Trainer.save_checkpoint``, then its
    process ends (the exit hook finishes the save; here: close)."""
    io = IncrementalCheckpointIO(min_object_age_s=0)
    io.save_checkpoint(checkpoint, path)
    io.close()


def test_ddp_spawn_main_process_leaves_no_thread_lease_or_store(tmp_path: Path) -> None:
    # Lightning's launcher, in the main process: load_checkpoint(weights), then
    # remove_checkpoint(weights), and never teardown.
    weights = tmp_path / "spawn" / ".temp.ckpt"
    expected = net(3).state_dict()
    worker_save(weights, expected)
    main = IncrementalCheckpointIO()
    assert_state_equal(main.load_checkpoint(weights), expected)
    assert our_threads() == []  # a read holds nothing once it returned
    main.remove_checkpoint(weights)
    assert our_threads() == []
    # the only pointer is gone and the store held nothing else: no copy of the weights stays
    assert os.listdir(tmp_path / "spawn") == []


def test_remove_of_a_read_store_releases_its_lease(tmp_path: Path) -> None:
    keep, gone = tmp_path / "keep.ckpt", tmp_path / "gone.ckpt"
    worker_save(keep, state(1))
    worker_save(gone, state(2))
    main = IncrementalCheckpointIO()
    main.load_checkpoint(gone)
    main.remove_checkpoint(gone)
    assert our_threads() == []
    record = newest(open_storage(str(tmp_path / ".incremental"), None))
    assert record is not None and record.doc.get("released") is True
    assert_state_equal(main.load_checkpoint(keep), state(1))
    assert our_threads() == []


def packs(store: Path) -> set[str]:
    return {p.name for p in store.rglob("*") if p.is_file() and "pack" in str(p)}


@pytest.mark.parametrize("load_first", [True, False])
def test_remove_after_load_deletes_the_step_objects(tmp_path: Path, load_first: bool) -> None:
    io = IncrementalCheckpointIO(min_object_age_s=0)
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    io.save_checkpoint(state(1), a)
    io.wait()
    only_a = packs(tmp_path / ".incremental")
    io.save_checkpoint(state(2), b)  # other tensors: other objects
    io.wait()
    assert packs(tmp_path / ".incremental") != only_a
    if load_first:
        io.load_checkpoint(b)  # b, the newest, becomes the next save's delta base
    io.remove_checkpoint(b)
    io.wait()
    assert packs(tmp_path / ".incremental") == only_a
    assert_state_equal(io.load_checkpoint(a), state(1))
    io.close()


def test_young_objects_stay_until_a_later_sweep(tmp_path: Path) -> None:
    # default min_object_age_s (900 s): removing a checkpoint deletes its manifest at once;
    # objects that young stay (another writer's save in flight may name them)
    io = IncrementalCheckpointIO()
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    io.save_checkpoint(state(1), a)
    io.save_checkpoint(state(2), b)
    io.wait()
    store = CheckpointStore(str(tmp_path / ".incremental"))
    assert store.steps() == [0, 1]
    before = packs(tmp_path / ".incremental")
    io.remove_checkpoint(b)
    io.close()
    assert store.steps() == [0]
    assert packs(tmp_path / ".incremental") == before
    store.close()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_urls_load(http_root: tuple[Path, str]) -> None:
    root, url = http_root
    model = net(5)
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    worker_save(root / "run" / "a.ckpt", checkpoint)
    io = IncrementalCheckpointIO()
    assert_state_equal(io.load_checkpoint(f"{url}/run/a.ckpt")["state_dict"], model.state_dict())
    io.close()
    loaded = lightning_incremental.load_from_checkpoint(Net, f"{url}/run/a.ckpt")
    assert_state_equal(loaded.state_dict(), model.state_dict())


def test_async_checkpoint_io_is_refused(tmp_path: Path) -> None:
    inner = IncrementalCheckpointIO()
    wrapped = AsyncCheckpointIO(inner)
    with pytest.raises(ValueError, match="drop AsyncCheckpointIO"):
        # raised by its save thread: AsyncCheckpointIO raises it at its next call
        wrapped.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
        wrapped.teardown()
    assert not (tmp_path / "a.ckpt").exists()
    with pytest.raises(ValueError, match="drop AsyncCheckpointIO"):
        wrapped.load_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="drop AsyncCheckpointIO"):
        wrapped.remove_checkpoint(tmp_path / "a.ckpt")
    inner.close()


@pytest.mark.slow
def test_ddp_spawn_fit_leaves_no_thread_nor_temporary_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where rank 0 saves the weights for the main process
    model = net()
    fit = trainer(
        tmp_path, IncrementalCheckpointIO(), [], max_steps=2, strategy="ddp_spawn",
        accelerator="cpu", devices=2,
    )  # fmt: skip
    fit.fit(model, data())
    assert our_threads() == []
    assert [p for p in temp.rglob("*") if p.name == ".incremental"] == []
