"""Verifying a checkpoint leaves the heap that existed before it out of garbage collection
(``buffers.heap_frozen``): the collections its checks trigger scan what the verification made,
not the whole process again and again. Garbage made meanwhile is still collected."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, buffers
from lightning_incremental.core.buffers import collection_paused, heap_frozen
from lightning_incremental.core.maintain import verify


@pytest.fixture(autouse=True)
def _nothing_frozen() -> None:
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects: heap_frozen leaves them be")


def _cycle() -> None:
    a: list[Any] = []
    a.append(a)


def test_the_heap_is_frozen_while_a_checkpoint_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(64) for i in range(300)}
    with CheckpointStore(tmp_path / "s") as store:
        store.save(state, 1).wait()
        seen: list[tuple[int, int]] = []
        original = verify._check_chunks

        def recorded(*args: Any) -> Any:
            seen.append((gc.get_freeze_count(), len(gc.get_objects())))
            return original(*args)

        monkeypatch.setattr(verify, "_check_chunks", recorded)
        before = len(gc.get_objects())
        report = store.verify(1)
    assert report.ok
    [(frozen, _)] = seen
    assert frozen >= before // 2, (frozen, before)  # the heap alive before it: left out
    assert gc.get_freeze_count() == 0  # and put back after


def _tracked(obj: object) -> bool:
    """Whether ``obj`` is in a generation collection scans (not frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_garbage_made_inside_is_collected_and_blocks_nest() -> None:
    with heap_frozen():
        assert gc.get_freeze_count() > 0
        _cycle()
        assert gc.collect() >= 1  # made inside: collected as usual
        made: list[Any] = []
        with heap_frozen():
            assert buffers._freezes == 2
            assert _tracked(made)  # the inner block froze nothing more
        assert gc.get_freeze_count() > 0  # frozen until the outer block ends
    assert gc.get_freeze_count() == 0


def test_overlapping_blocks_in_two_threads_unfreeze_when_the_last_ends() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with heap_frozen():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with heap_frozen():
        pass
    assert gc.get_freeze_count() > 0  # the other thread's block still runs
    release.set()
    thread.join()
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_elsewhere_is_left_alone() -> None:
    gc.freeze()
    try:
        with heap_frozen():
            assert buffers._froze is False  # not frozen by it: not its to undo
        with collection_paused():
            pass
        assert gc.get_freeze_count() > 0  # not undone by either
    finally:
        gc.unfreeze()
