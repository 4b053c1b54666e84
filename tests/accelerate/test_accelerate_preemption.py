"""The checkpointer's preemption path in one process: a request (a signal, or
``request_preemption``) is acted on at the next batch of a tracked epoch — that step is saved and
committed, and the process exits 143 — through the API (the newest step given to ``maybe_save``)
and the launch flag (what ``accelerator.save_state()`` does). The real-signal, real-process runs
are tests/multiprocess/test_accelerate_preemption.py."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from accelerate_incremental import IncrementalCheckpointer, enable
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.policy.preemption import EXIT_PREEMPTED, PreemptionConfig
from tests.accelerate.test_accelerate import make_run


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """A fresh Accelerate state, and the signal handlers put back (a preempted checkpointer
    leaves its signals ignored: the process is on its way out)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def _restart() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_any_true_alone_is_the_flag() -> None:
    assert collectives.any_true(True) is True
    assert collectives.any_true(False) is False


def test_api_saves_the_newest_step_at_the_next_batch_and_exits_143(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, url, every_n_steps=3)
    seen = 0
    with pytest.raises(SystemExit) as exited:
        for x, y in ckpt.iterate(run.loader):
            seen += 1
            run.step(x, y)
            ckpt.maybe_save(run.counter.value)
            if run.counter.value == 4:
                ckpt.request_preemption("a test")
    assert exited.value.code == EXIT_PREEMPTED
    assert seen == 4, "no batch is fetched after the request"
    assert ckpt.steps() == [3, 4]
    ckpt.close()

    _restart()
    again = make_run()
    with IncrementalCheckpointer(again.acc, url, every_n_steps=3) as resumed:
        assert resumed.load() == 4
        assert sum(1 for _ in resumed.iterate(again.loader)) == 2  # the epoch's other 2 batches


def test_api_with_the_newest_step_saved_has_nothing_new_to_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"), every_n_steps=3)
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):
        for x, y in ckpt.iterate(run.loader):
            run.step(x, y)
            ckpt.maybe_save(run.counter.value)
            if run.counter.value == 3:
                ckpt.request_preemption()
    assert ckpt.steps() == [3]
    assert "step 3 is saved already, nothing new to save" in caplog.text
    assert "preempted: step 3 committed" in caplog.text
    ckpt.close()


def test_launch_flag_saves_what_save_state_does_in_a_plain_loop(tmp_path: Path) -> None:
    """No ``save_state()`` call in the script: the preemption saves checkpoint
    ``project_configuration.iteration`` (0) and increments it; a preemption right after
    ``load_state()``, before the resumed epoch's first batch, keeps the restored position."""
    url = str(tmp_path / "s")
    ref = make_run()
    reference = [x.clone() for x, _ in ref.loader]
    _restart()
    run = make_run()
    ckpt = enable(run.acc, url)
    assert ckpt is not None
    with pytest.raises(SystemExit) as exited:
        for x, y in run.loader:
            run.step(x, y)
            if run.counter.value == 2:
                ckpt.request_preemption()
    assert exited.value.code == EXIT_PREEMPTED
    assert ckpt.steps() == [0]
    assert run.acc.project_configuration.iteration == 1
    ckpt.close()

    _restart()
    second = make_run()
    ckpt = enable(second.acc, url)
    assert ckpt is not None and second.acc.load_state() == 0
    ckpt.request_preemption()
    with pytest.raises(SystemExit):
        next(iter(second.loader))
    assert ckpt.steps() == [0, 1]
    ckpt.close()

    _restart()
    third = make_run()
    ckpt = enable(third.acc, url)
    assert ckpt is not None and third.acc.load_state() == 1
    assert third.counter.value == 2
    rest = [x.clone() for x, _ in third.loader]
    assert len(rest) == 4 and all(torch.equal(a, b) for a, b in zip(rest, reference[2:]))
    ckpt.close()


def test_the_handler_is_installed_at_construction_and_removed_at_close(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"))
    assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_preemption_off_leaves_the_signals_and_ignores_requests(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(tmp_path / "s"), preemption=False) as ckpt:
        assert signal.getsignal(signal.SIGTERM) == before
        ckpt.request_preemption()
        assert sum(1 for _ in ckpt.iterate(run.loader)) == 6


def test_preemption_argument_is_checked(tmp_path: Path) -> None:
    run = make_run()
    with pytest.raises(TypeError, match="preemption must be a bool or a PreemptionConfig"):
        IncrementalCheckpointer(run.acc, str(tmp_path / "s"), preemption="yes")  # type: ignore[arg-type]
    config = PreemptionConfig(grace_s=5.0)
    with IncrementalCheckpointer(run.acc, str(tmp_path / "s"), preemption=config) as ckpt:
        assert ckpt._preemption.config is config
