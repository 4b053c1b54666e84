"""An ``IncrementalCheckpointer``'s creation is its start as a writer, on a real
``Accelerator(cpu=True)``: a second checkpointer on the store of a live run, or on a store it
cannot write, is refused there — before it loads anything or the script trains — naming the
live writer (or the location and the error), and the live run is left alone; ``read_only``
checkpointers load beside a live writer; the launch flag's ``enable`` is refused alike."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from accelerate_incremental import IncrementalCheckpointer, enable
from lightning_incremental.core import (
    CheckpointStore,
    ConfigError,
    StoreNotWritableError,
    WriterLeaseError,
)
from tests.accelerate.test_accelerate import make_run, same, weights
from tests.faulty import read_only_directory
from tests.live_writer import JOB, live_writer, store_files


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def live_run(url: str) -> dict[str, torch.Tensor]:
    """A run that saved steps 1 and 2; its weights at step 2."""
    run = make_run()
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    with IncrementalCheckpointer(run.acc, url) as ckpt:
        for step in (1, 2):
            run.step(x, y)
            ckpt.save(step)
    saved = weights(run)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return saved


def test_a_second_checkpointer_on_a_live_runs_store_is_refused_at_creation(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "store")
    saved = live_run(url)
    with live_writer(url) as live:
        before = store_files(url)
        run = make_run()
        initial = weights(run)
        with pytest.raises(WriterLeaseError) as raised:
            IncrementalCheckpointer(run.acc, url, every_n_steps=1)
        message = str(raised.value)
        for named in (f"host {socket.gethostname()}", f"pid {live.pid}", f"job {JOB}"):
            assert named in message
        assert "wait for that writer to finish" in message and "another dirpath" in message
        assert same(weights(run), initial) and not same(initial, saved)  # nothing loaded
        assert store_files(url) == before
        with pytest.raises(WriterLeaseError, match=f"pid {live.pid}"):
            enable(run.acc, url)  # the launch flag's way in: refused alike
        assert store_files(url) == before
    assert live.still_writer


def test_a_store_that_cannot_be_written_is_refused_at_creation(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    live_run(url)
    before = store_files(url)
    with read_only_directory(url):
        run = make_run()
        with pytest.raises(StoreNotWritableError, match=f"cannot write the checkpoint store {url}"):
            IncrementalCheckpointer(run.acc, url)
    assert store_files(url) == before


def test_read_only_loads_beside_a_live_writer_and_from_a_read_only_store(tmp_path: Path) -> None:
    """Inference and evaluation: ``read_only=True`` takes no lease, probes nothing, never
    saves; it restores the live run's newest checkpoint."""
    url = str(tmp_path / "store")
    saved = live_run(url)
    with live_writer(url) as live:
        run = make_run()
        with IncrementalCheckpointer(run.acc, url, read_only=True) as reader:
            assert reader.load() == 2
            assert same(weights(run), saved)
            with pytest.raises(ConfigError, match="read_only=True"):
                reader.save(3)
    assert live.still_writer
    with CheckpointStore(url) as store:
        assert store.steps() == [1, 2]
    with read_only_directory(url):
        run = make_run()
        with IncrementalCheckpointer(run.acc, url, read_only=True) as reader:
            assert reader.load() == 2
    with pytest.raises(ConfigError, match="every_n_steps would write"):
        IncrementalCheckpointer(make_run().acc, url, read_only=True, every_n_steps=2)


def test_a_checkpointer_of_the_process_holding_the_lease_shares_it(tmp_path: Path) -> None:
    """A second checkpointer (or store) of the same process is the same writer, not a second."""
    url = str(tmp_path / "store")
    run = make_run()
    with IncrementalCheckpointer(run.acc, url) as first, CheckpointStore(url) as beside:
        beside.acquire_writer()
        first.save(1)
        first.wait()
        assert first.steps() == [1]
