"""Plain loops (``for batch in loader``) over prepared DataLoaders of an accelerator with the
integration installed (``enable`` / the launch module): the position in the epoch is tracked as
through ``checkpointer.iterate``, so a resume continues exactly where the checkpoint stood."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, IterableDataset

from accelerate_incremental import IncrementalCheckpointer, _tracking, enable
from tests.accelerate.test_accelerate import Run, make_run, same, weights


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def restart(url: str, *, generator: bool = True) -> tuple[Run, IncrementalCheckpointer]:
    """A new process's view: fresh accelerator state, a different RNG state, enabled."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = make_run(generator=generator)
    torch.manual_seed(999)
    ckpt = enable(run.acc, url)
    assert ckpt is not None
    return run, ckpt


def plain_epoch(run: Run, stop_after: int | None = None) -> list[torch.Tensor]:
    seen = []
    for x, y in run.loader:
        run.step(x, y)
        seen.append(x.clone())
        if len(seen) == stop_after:
            break
    return seen


@pytest.mark.parametrize("generator", [True, False], ids=["own-generator", "global-rng"])
def test_plain_loop_mid_epoch_resume_is_exact(tmp_path: Path, generator: bool) -> None:
    """Saved with ``save_state()`` after 2 of an epoch's 6 batches, a restarted run that iterates
    the loader directly continues with the same 4 batches in the same order and the same random
    state (dropout), then the next epoch matches too."""
    url = str(tmp_path / "s")
    ref = make_run(generator=generator)
    ckpt = enable(ref.acc, url)
    assert ckpt is not None
    plain_epoch(ref)
    torch.manual_seed(42)  # what the epoch-1 order depends on when there is no generator
    rest: list[torch.Tensor] = []
    for i, (x, y) in enumerate(ref.loader):
        ref.step(x, y)
        if i == 1:
            ref.acc.save_state()
        elif i > 1:
            rest.append(x.clone())
    epoch2 = plain_epoch(ref)
    final = weights(ref)

    run, _ = restart(url, generator=generator)
    assert run.acc.load_state() == 0
    assert run.counter.value == 8 and run.loader.iteration == 1
    got_rest = plain_epoch(run)
    assert len(got_rest) == len(rest) == 4
    assert all(torch.equal(a, b) for a, b in zip(rest, got_rest, strict=True))
    assert run.loader.iteration == 2
    got_epoch2 = plain_epoch(run)
    assert all(torch.equal(a, b) for a, b in zip(epoch2, got_epoch2, strict=True))
    assert same(final, weights(run))


def train(run: Run, *, save_every: int, stop_at: int = -1, epochs: int = 3) -> None:
    """``for epoch in range(step // len(loader), epochs)`` (the epoch derived from the restored
    step, as in Accelerate's examples), ``save_state()`` every ``save_every`` steps."""
    for _ in range(run.counter.value // len(run.loader), epochs):
        for x, y in run.loader:
            run.step(x, y)
            if run.counter.value % save_every == 0:
                run.acc.save_state()
            if run.counter.value == stop_at:
                return


def test_save_on_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path: Path) -> None:
    """A ``save_state()`` at an epoch's last batch holds the next epoch's start: the restarted
    run derives epoch 1 from the step and runs all of it (not an empty rest of epoch 0)."""
    ref, _ = restart(str(tmp_path / "ref"))
    train(ref, save_every=6)
    final = weights(ref)
    url = str(tmp_path / "run")
    first, _ = restart(url)
    train(first, save_every=6, stop_at=8)  # the newest checkpoint: step 6, epoch 0's last batch
    run, _ = restart(url)
    assert run.acc.load_state() == 0
    assert run.counter.value == 6 and run.loader.iteration == 1
    train(run, save_every=6)
    assert run.counter.value == 18
    assert same(final, weights(run))


def test_iterate_and_plain_loop_share_one_position(tmp_path: Path) -> None:
    """Half an epoch through ``ckpt.iterate`` and half through a plain loop of the same epoch's
    iterator are one epoch; a save in it resumes exactly in either style."""
    url = str(tmp_path / "s")
    ref = make_run()
    ckpt = enable(ref.acc, url)
    assert ckpt is not None
    batches = ckpt.iterate(ref.loader)
    for _ in range(3):
        ref.step(*next(batches))
    ref.acc.save_state()
    rest = [x.clone() for x, _ in batches]
    run, resumed = restart(url)
    assert run.acc.load_state() == 0
    got = [x.clone() for x, _ in resumed.iterate(run.loader)]
    assert all(torch.equal(a, b) for a, b in zip(rest, got, strict=True)) and len(got) == 3


def test_skip_first_batches_on_a_tracked_loader(tmp_path: Path) -> None:
    """The script's own ``accelerator.skip_first_batches(loader, n)``: with a restored position
    pending and the same ``n``, the loader itself continues it; a different ``n`` warns and the
    checkpoint's position wins; with nothing pending, the skipped epoch is still tracked, so a
    save inside it resumes exactly."""
    url = str(tmp_path / "s")
    ref = make_run()
    assert enable(ref.acc, url) is not None
    skipped = ref.acc.skip_first_batches(ref.loader, 2)
    assert skipped is ref.loader
    seen = []
    for i, (x, y) in enumerate(skipped):
        ref.step(x, y)
        seen.append(x.clone())
        if i == 0:
            ref.acc.save_state()  # 3 batches into the epoch
    assert len(seen) == 4 and ref.loader.iteration == 1
    for matching in (True, False):
        run, _ = restart(url)
        assert run.acc.load_state() == 0
        if matching:
            loader = run.acc.skip_first_batches(run.loader, 3)
        else:
            with pytest.warns(UserWarning, match="stood 3 batches into this epoch"):
                loader = run.acc.skip_first_batches(run.loader, 1)
        assert loader is run.loader
        got = [x.clone() for x, _ in loader]
        assert all(torch.equal(a, b) for a, b in zip(seen[1:], got, strict=True))
        assert len(got) == 3


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(12, dtype=torch.float32).reshape(12, 1))


def test_iterable_dataset_resume_is_warned(tmp_path: Path) -> None:
    """An IterableDataset has no saved position: a mid-epoch resume re-reads the consumed
    batches and is exact only for a stream that repeats itself; it says so."""
    url = str(tmp_path / "s")
    acc = Accelerator(cpu=True)
    _model, loader = acc.prepare(torch.nn.Linear(1, 1), DataLoader(Stream(), batch_size=2))
    assert enable(acc, url) is not None
    batches = iter(loader)
    next(batches)
    acc.save_state()
    expected = [b.clone() for b in batches]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    _model, loader = acc.prepare(torch.nn.Linear(1, 1), DataLoader(Stream(), batch_size=2))
    assert enable(acc, url) is not None
    with pytest.warns(UserWarning, match="IterableDataset.*reads and discards those batches"):
        acc.load_state()
    got = list(loader)
    assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_enable_twice_and_release(tmp_path: Path) -> None:
    run = make_run()
    ckpt = enable(run.acc, str(tmp_path / "s"))
    assert ckpt is not None and _tracking.is_tracked(run.loader)
    assert enable(run.acc) is ckpt
    with pytest.raises(ValueError, match="already enabled, with the store"):
        enable(run.acc, str(tmp_path / "other"))
    assert isinstance(run.loader, DataLoader) and len(run.loader) == 6
    ckpt.release()
    assert not _tracking.is_tracked(run.loader)
    assert type(run.loader).__name__ == "DataLoaderShard" and len(list(run.loader)) == 6
    assert not {"save_state", "load_state", "skip_first_batches"} & set(vars(run.acc))
