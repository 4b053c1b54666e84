"""IncrementalCheckpointer's memory tier in one process, on a real Accelerator: a run that
crashes after step 9 resumes from the memory step 9 (the store holds 8) bit-identically and
frees the memory once the store holds the end; another job's memory is ignored; the tier is off
by default; the launch flag's JSON carries the memory keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from accelerate_incremental import IncrementalCheckpointer, enable
from accelerate_incremental._flag import ENV_CONFIG
from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.memory.tier import ENV
from tests.accelerate.test_accelerate import make_run, same, weights

TOTAL = 16  # steps; an epoch is 6 batches, the store saves every 4


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train(store: Path, *, crash_after: int | None = None, **kw: Any) -> tuple[Any, Any, int]:
    """Train to ``TOTAL`` steps from whatever ``load`` finds; ``crash_after``: stop after that
    step as a killed process would (its memory written, nothing else finished)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = make_run()
    torch.manual_seed(1234)  # a restarted process's random state differs before load
    ckpt = IncrementalCheckpointer(run.acc, str(store), every_n_steps=4, **kw)
    step = loaded = ckpt.load() or 0
    while step < TOTAL:
        for x, y in ckpt.iterate(run.loader):
            run.step(x, y)
            step += 1
            ckpt.maybe_save(step)
            if step == crash_after:
                # a failing run's close: the memory write in hand finishes (as it has before
                # a kill lands), a save due at the epoch's end is not taken
                ckpt.close(finished=False)
                return run, ckpt, loaded
            if step == TOTAL:
                break
    ckpt.close()
    return run, ckpt, loaded


def parts(memory: Path) -> list[str]:
    return sorted(p.name for p in memory.glob("*/s*"))  # every job's


def test_a_crash_resumes_from_memory_bit_identically(tmp_path: Path) -> None:
    reference, _, _ = train(tmp_path / "reference")
    memory = tmp_path / "memory"
    args = {"memory_every_n_steps": 1, "memory_dir": str(memory)}
    train(tmp_path / "store", crash_after=9, **args)
    assert parts(memory) == ["s000000000009-g000001-r000000"]  # only the newest is kept
    run, ckpt, loaded = train(tmp_path / "store", **args)
    assert (loaded, ckpt.resumed_tier) == (9, "memory")  # the store holds step 8
    assert same(weights(run), weights(reference))
    assert ckpt.steps()[-1] == TOTAL
    assert parts(memory) == []  # the store holds the last step: the memory is freed


def test_an_epochs_last_step_is_not_taken_and_an_older_memory_defers_to_the_store(
    tmp_path: Path,
) -> None:
    """Step 12 ends an epoch (its end work comes after it): a crash there resumes from memory
    step 11, still bit-identical; memory older than the store's newest is not used."""
    reference, _, _ = train(tmp_path / "reference")
    args = {"memory_every_n_steps": 1, "memory_dir": str(tmp_path / "memory")}
    train(tmp_path / "store", crash_after=12, **args)
    run, ckpt, loaded = train(tmp_path / "store", **args)
    assert (loaded, ckpt.resumed_tier) == (11, "memory")
    assert same(weights(run), weights(reference))
    sparse = {"memory_every_n_steps": 5, "memory_dir": str(tmp_path / "memory-5")}
    train(tmp_path / "store-5", crash_after=9, **sparse)  # memory holds 5, the store 8
    run, ckpt, loaded = train(tmp_path / "store-5", **sparse)
    assert (loaded, ckpt.resumed_tier) == (8, "store")
    assert same(weights(run), weights(reference))


def test_another_jobs_memory_is_ignored(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    args = {"memory_every_n_steps": 1, "memory_dir": str(memory)}
    train(tmp_path / "one", crash_after=9, **args)
    _, ckpt, loaded = train(tmp_path / "other", **args)
    assert (loaded, ckpt.resumed_tier) == (0, None)  # nothing to resume from
    assert parts(memory) == ["s000000000009-g000001-r000000"]  # the first job's, untouched
    _, again, loaded = train(tmp_path / "one", **args)
    assert (loaded, again.resumed_tier) == (9, "memory")


def test_the_memory_tier_is_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "memory"))
    train(tmp_path / "store", crash_after=9)
    _, ckpt, loaded = train(tmp_path / "store")
    assert (loaded, ckpt.resumed_tier) == (8, "store")
    assert not (tmp_path / "memory").exists()
    with pytest.raises(ConfigError, match="memory_every_n_steps"):
        IncrementalCheckpointer(make_run().acc, str(tmp_path / "x"), memory_every_n_steps=0)


def test_the_launch_flag_json_turns_the_memory_tier_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = tmp_path / "memory"
    config = tmp_path / "incremental.json"
    settings = {"dirpath": str(tmp_path / "store"), "memory_every_n_steps": 2}
    config.write_text(json.dumps({**settings, "memory_replicas": 0, "memory_dir": str(memory)}))
    monkeypatch.setenv(ENV_CONFIG, str(config))
    run = make_run()
    ckpt = enable(run.acc)
    assert ckpt is not None
    for step, (x, y) in enumerate(run.loader, start=1):
        run.step(x, y)
        ckpt.maybe_save(step)
        if step == 3:
            break
    ckpt.wait()
    assert parts(memory) == ["s000000000002-g000001-r000000"]
    ckpt.close(finished=False)


def test_a_resume_from_memory_at_the_last_step_saves_it_at_close_and_frees_the_memory(
    tmp_path: Path,
) -> None:
    """The run dies after the memory step of its last step (16), with the store's save of that
    step lost in flight. The next run resumes from memory at step 16, has no step left to
    train and calls no ``maybe_save``: ``close`` saves step 16 to the store and frees the
    memory (before, the store kept step 12 and the memory stayed until a next run)."""
    from lightning_incremental.core import CheckpointStore

    reference, _, _ = train(tmp_path / "reference")
    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {"memory_every_n_steps": 1, "memory_dir": str(memory)}
    train(store, crash_after=TOTAL, **args)
    assert parts(memory) == [f"s{TOTAL:012d}-g000001-r000000"]
    CheckpointStore(store).delete(TOTAL)  # stands for the save lost in flight
    run, ckpt, loaded = train(store, **args)
    assert (loaded, ckpt.resumed_tier) == (TOTAL, "memory")
    assert ckpt.steps()[-1] == TOTAL
    assert parts(memory) == []
    assert same(weights(run), weights(reference))
    restored = CheckpointStore(store).load(TOTAL)  # the step saved at close is the resumed one
    final = CheckpointStore(tmp_path / "reference").load(TOTAL)
    assert all(same(a, b) for a, b in zip(restored["models"], final["models"], strict=True))


def test_a_step_after_a_memory_resume_is_not_saved_under_the_resumed_step(tmp_path: Path) -> None:
    """A resume from memory at a step the store lacks, then a training step whose maybe_save
    is not due: close does not save the moved-on state as the resumed step."""
    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {"memory_every_n_steps": 1, "memory_dir": str(memory)}
    train(store, crash_after=9, **args)  # the store holds 8
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(store), every_n_steps=4, **args)
    assert (ckpt.load(), ckpt.resumed_tier) == (9, "memory")
    x, y = next(iter(ckpt.iterate(run.loader)))
    run.step(x, y)
    ckpt.maybe_save(10)  # not due
    ckpt.close()
    assert ckpt.steps()[-1] == 8
