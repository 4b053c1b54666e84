"""A reader polling ``load()`` beside a training job whose retention deletes checkpoints.

The training job (``keep_last``) may delete the very checkpoint a reader in another process is
restoring. That checkpoint vanished; it is not corrupt: the reader must not quarantine it nor warn
about corruption, but re-list and restore the newest committed checkpoint. An object missing from
a checkpoint whose manifest is still there remains corruption.

The race is driven by a storage whose read of a chosen object first runs a hook (the writer's
saves and retention, in between two reads of the reader), never by sleeps. Retention spares young
objects (``min_object_age_s``), so the hook removes the objects no remaining manifest names
itself, as the sweep would once they are old enough.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointNotFoundError, CheckpointStore
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal, small_store

BAD = ("corrupt", "unusable")


class HookedStorage(LocalStorage):
    """Local storage whose reads under ``prefix`` first run ``hook(path)``, ``times`` times."""

    def __init__(self, root: str, prefix: str, hook: Callable[[str], None], times: int) -> None:
        super().__init__(root)
        self.prefix, self.hook, self.left = prefix, hook, times
        self.fired: list[str] = []
        self._lock = threading.Lock()

    def _before_read(self, path: str) -> None:
        with self._lock:
            fire = path.startswith(self.prefix) and self.left > 0
            if fire:
                self.left -= 1
                self.fired.append(path)
        if fire:
            self.hook(path)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self._before_read(path)
        return super().get(path, start, end)

    def get_view(self, path: str, start: int, end: int) -> memoryview:
        self._before_read(path)
        return super().get_view(path, start, end)


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(900, generator=g), "k": step}


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "store")


class TrainingJob:
    """The writer: ``keep_last=1``, a full base every save (no object outlives its step)."""

    def __init__(self, root: str) -> None:
        self.store = small_store(root, keep_last=1, full_every=1)
        self.storage = LocalStorage(root)
        self.step = 0

    def save_next(self) -> None:
        self.step += 1
        self.store.save(state(self.step), self.step).wait()

    def sweep(self) -> set[str]:
        """Delete every object no remaining manifest names (retention's sweep, aged)."""
        named = {r.pack for s in self.store.steps() for r in self.store.manifest(s).chunks.values()}
        gone = set(self.storage.list("packs")) - named
        for path in gone:
            self.storage.delete(path)
        return gone

    def retire_and_sweep(self, path: str, saves: int) -> None:
        for _ in range(saves):
            self.save_next()
        gone = self.sweep()
        assert path.startswith(mf.MANIFEST_DIR) or path in gone, "the hook must delete the read"


def assert_no_corruption_reported(recorded: list, caplog, reader: CheckpointStore, root: str):
    messages = [str(w.message) for w in recorded] + [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ]
    assert not [m for m in messages if any(word in m for word in BAD)], messages
    assert not reader._history.quarantined
    assert not LocalStorage(root).list(mf.QUARANTINE_DIR)


def test_a_checkpoint_deleted_while_being_read_is_skipped_for_the_newest(root, caplog) -> None:
    job = TrainingJob(root)
    job.save_next()
    job.save_next()  # committed: [2]
    hooked = HookedStorage(root, "packs/", lambda path: job.retire_and_sweep(path, 2), times=1)
    reader = small_store(hooked)
    caplog.set_level(logging.INFO, logger="lightning_incremental")
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        loaded = reader.load()
    assert len(hooked.fired) == 1 and reader.steps() == [4]
    assert_state_equal(loaded, state(4))
    assert_no_corruption_reported(recorded, caplog, reader, root)


def test_a_manifest_deleted_between_listing_and_reading_is_skipped(root, caplog) -> None:
    job = TrainingJob(root)
    job.save_next()
    hooked = HookedStorage(
        root, mf.MANIFEST_DIR + "/", lambda path: job.retire_and_sweep(path, 2), times=1
    )
    reader = small_store(hooked)
    caplog.set_level(logging.INFO, logger="lightning_incremental")
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        loaded = reader.load()
    assert len(hooked.fired) == 1
    assert_state_equal(loaded, state(3))
    assert_no_corruption_reported(recorded, caplog, reader, root)


def test_an_explicit_step_deleted_while_being_read_is_not_found_not_corrupt(root, caplog) -> None:
    job = TrainingJob(root)
    job.save_next()
    hooked = HookedStorage(root, "packs/", lambda path: job.retire_and_sweep(path, 2), times=1)
    reader = small_store(hooked)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointNotFoundError, match="deleted while being read"):
            reader.load(1)
    assert_no_corruption_reported(recorded, caplog, reader, root)
    assert_state_equal(reader.load(3), state(3))


def test_checkpoints_deleted_faster_than_they_are_read_give_up_clearly(root, caplog) -> None:
    job = TrainingJob(root)
    job.save_next()
    hooked = HookedStorage(root, "packs/", lambda path: job.retire_and_sweep(path, 1), times=1000)
    reader = small_store(hooked)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointNotFoundError, match=r"deleted while being read.*keep_last"):
            reader.load()
    assert 2 <= len(hooked.fired) <= 20  # bounded: it gave up, it did not loop
    assert_no_corruption_reported(recorded, caplog, reader, root)


def test_an_object_missing_from_a_checkpoint_still_there_is_corruption(root) -> None:
    with small_store(root, full_every=1) as writer:
        for step in (1, 2):
            writer.save(state(step), step).wait()
        first = {r.pack for r in writer.manifest(1).chunks.values()}
        only_2 = sorted({r.pack for r in writer.manifest(2).chunks.values()} - first)
    storage = LocalStorage(root)
    storage.delete(only_2[0])  # the manifest of step 2 stays: it is committed, and broken
    reader = small_store(root)
    with pytest.warns(UserWarning, match="step 2 .* is unusable.*missing"):
        loaded = reader.load()
    assert_state_equal(loaded, state(1))
    assert reader._history.quarantined == {2}
    with pytest.raises(Exception, match="missing") as raised:
        small_store(root).load(2)
    assert not isinstance(raised.value, CheckpointNotFoundError)


class CompactingJob:
    """A writer with delta chains whose maintenance compacts the newest checkpoint and then
    collects with keep_last=1 (no minimum age: the old chain's objects go at once)."""

    def __init__(self, root: str) -> None:
        self.store = small_store(root, full_every=100, min_object_age_s=0)
        g = torch.Generator().manual_seed(0)
        self.state = state(0)
        for step in (1, 2):
            self.state = {
                "w": self.state["w"] + 1e-3 * torch.randn(64, 64, generator=g),
                "b": self.state["b"] + 1e-3 * torch.randn(900, generator=g),
                "k": step,
            }
            self.store.save(self.state, step).wait()
        assert not self.store.manifest(2).stats["full_base"]
        self.before = set(LocalStorage(self.store.url).list("packs"))

    def compact_and_collect(self, path: str) -> None:
        self.store.compact()
        self.store.gc(keep_last=1)
        assert path not in set(LocalStorage(self.store.url).list("packs")), "read one is gone"


@pytest.mark.parametrize("explicit", [False, True], ids=["newest", "step"])
def test_a_checkpoint_compacted_and_collected_while_being_read_is_read_again(
    root, caplog, explicit: bool
) -> None:
    """The reader lists step 2 (a delta) and starts reading its objects; meanwhile the writer
    compacts step 2 and collects with keep_last=1, which removes the old chain's objects. Step
    2 is still committed, now as a full base: the reader reads it again — never corrupt."""
    job = CompactingJob(root)
    hooked = HookedStorage(root, "packs/", job.compact_and_collect, times=1)
    reader = small_store(hooked)
    caplog.set_level(logging.INFO, logger="lightning_incremental")
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        loaded = reader.load(2) if explicit else reader.load()
    assert len(hooked.fired) == 1 and reader.steps() == [2]
    assert_state_equal(loaded, job.state)
    assert reader.manifest(2).stats["full_base"]
    assert_no_corruption_reported(recorded, caplog, reader, root)
    assert reader.verify(2).ok
