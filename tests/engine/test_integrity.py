"""A committed step always loads: retention errors, objects vanishing under gc, rotten objects
reused by hash, retention after damage, disk use under keep_last, and hostile or absurd input.

Each test damages or disturbs a store the way a real failure would, then checks the promise:
what a save reports committed verifies and restores bit-exactly, what gc keeps includes an
intact checkpoint, and every refusal is a typed error naming the problem.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.cli import main
from lightning_incremental.core import (
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    StepError,
    StorageError,
    UnsupportedValueError,
)
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.sweep import STALE_TMP_S
from lightning_incremental.core.storage import LocalStorage, open_storage, translate_errors
from tests.conftest import assert_state_equal, small_store
from tests.faulty import FaultyStorage


def states(steps: int, seed: int = 0, rows: int = 64) -> list[dict[str, Any]]:
    """A run: ``w`` changes a little every step (XOR deltas), ``frozen`` never (reused)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32, generator=g)
    frozen = torch.randn(rows, 32, generator=g)
    out = []
    for step in range(steps):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        out.append({"model": {"w": w.clone(), "frozen": frozen.clone()}, "step": step})
    return out


def rot(store: CheckpointStore, step: int, tensor: str) -> str:
    """Flip one byte in the encoded first chunk of ``tensor`` of checkpoint ``step`` (in place,
    as a disk would); returns the object hit."""
    doc = store.manifest(step).to_dict()
    entry = next(t for t in doc["tensors"] if t["path"] == f"state['model'][{tensor!r}]")
    recipe = doc["chunks"][entry["chunks"][0]]
    target = Path(store.url, *recipe["pack"].split("/"))
    data = bytearray(target.read_bytes())
    data[recipe["offset"] + recipe["length"] // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return str(recipe["pack"])


def pack_bytes(root: str) -> int:
    return sum(f.stat().st_size for f in Path(root, "packs").rglob("*.pack"))


# ---------------------------------------------------------------- retention after a commit


def test_failing_retention_is_a_warning_and_leaves_the_next_delta_base_alone(
    local_url: str,
) -> None:
    """A third-party storage raising a bare OSError while retention lists the objects: the save
    is committed, so it succeeds with a warning; the snapshot it leaves as XOR base is not
    recycled, so the next save (a delta against it) restores exactly."""
    run = states(5)
    faulty = FaultyStorage(open_storage(local_url, None))
    with small_store(faulty, keep_last=2) as store:  # a full base every 2 saves
        for step in (0, 1):
            store.save(run[step], step).wait()
        faulty.fail("pack", op="list", translate=False)
        with pytest.warns(UserWarning, match="retention after step 2 failed.*OSError"):
            result = store.save(run[2], 2).wait()
        assert result.full_base and result.warnings and "OSError" in result.warnings[0]
        assert faulty.raised and type(faulty.raised[0]) is OSError
        assert 2 in store.steps()
        result = store.save(run[3], 3).wait()
        assert result.chunks_delta > 0, "step 3 must be a delta against step 2's snapshot"
        assert store.verify(3).ok, store.verify(3).errors[:3]
        assert_state_equal(store.load(3), run[3])
        assert store.steps() == [2, 3]


class _VanishingStorage(LocalStorage):
    """Another process deletes every object this one is about to measure."""

    def size(self, path: str) -> int:
        os.unlink(self._abs(path))
        return super().size(path)


def test_gc_skips_objects_that_vanish_under_it(local_url: str) -> None:
    run = states(3)
    with small_store(local_url, full_every=1) as store:
        for step, state in enumerate(run):
            store.save(state, step).wait()
    with small_store(_VanishingStorage(local_url)) as collector:
        report = collector.gc(keep_last=1, grace_s=0)
        assert report.removed_steps == [0, 1] and report.removed_objects == []
    with small_store(local_url) as store:
        assert store.verify(2).ok
        assert_state_equal(store.load(), run[2])


# ---------------------------------------------------------------- rotten objects


@pytest.mark.parametrize("reopen", [False, True], ids=["same-process", "restarted"])
def test_a_rotten_object_is_not_reused(local_url: str, reopen: bool) -> None:
    """One byte flipped in the pack holding the unchanged tensor: every checkpoint is corrupt.
    The next saves hold the right bytes in memory: they must write them again instead of
    naming the rotten object, full bases included."""
    run = states(8)
    store = small_store(local_url, full_every=2)
    for step in range(3):
        store.save(run[step], step).wait()
    rot(store, 2, "frozen")
    if reopen:
        store.close()
        store = small_store(local_url, full_every=2)  # knows nothing about the damage
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
                store.load()
    try:
        for step in range(3, 7):
            store.save(run[step], step).wait()
            report = store.verify(step)
            assert report.ok, (step, report.errors[:3])
            assert_state_equal(store.load(step), run[step])
    finally:
        store.close()


# ---------------------------------------------------------------- retention after damage


def test_gc_keeps_the_newest_intact_checkpoint(local_url: str) -> None:
    run = states(3)
    with small_store(local_url, full_every=1) as store:
        for step, state in enumerate(run):
            store.save(state, step).wait()
        rot(store, 2, "w")
        with pytest.warns(UserWarning, match="step 2 .* unusable"):
            assert_state_equal(store.load(), run[1])
        report = store.gc(keep_last=1)
        assert report.kept_intact == 1 and report.removed_steps == [0]
        assert store.steps() == [1, 2]
        with pytest.warns(UserWarning, match="step 2 .* unusable"):
            assert_state_equal(store.load(), run[1])


def test_gc_of_a_fresh_process_and_the_command_keep_the_newest_intact(local_url: str) -> None:
    run = states(3)
    with small_store(local_url, full_every=1) as store:
        for step, state in enumerate(run):
            store.save(state, step).wait()
        rot(store, 2, "w")
    assert main(["gc", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    with small_store(local_url) as store:
        assert store.steps() == [1, 2]
        assert store.verify(1).ok and not store.verify(2).ok
    # nothing intact at all: no checkpoint is removed
    with small_store(local_url) as store:
        rot(store, 1, "w")
        report = store.gc(keep_last=1)
        assert report.removed_steps == [] and store.steps() == [1, 2]


# ---------------------------------------------------------------- disk use


def test_keep_last_bounds_disk_use(local_url: str) -> None:
    """Dense updates (deltas as large as full chunks): with keep_last=2 the packs on disk stay
    about two to three checkpoints, not the ten a full_every=10 chain would pin."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    # One writer, nothing in flight elsewhere: sweep at once (min_object_age_s=0).
    with small_store(
        local_url, keep_last=2, full_every=10, chunk_size=16384, min_object_age_s=0
    ) as store:
        first = store.save({"w": w}, 0).wait().bytes_written
        peak = 0
        for step in range(1, 25):
            w = w + torch.randn(w.shape, generator=g)
            store.save({"w": w}, step).wait()
            peak = max(peak, pack_bytes(local_url))
        assert store.steps() == [23, 24]
        assert_state_equal(store.load(), {"w": w})
    assert peak <= 3.2 * first, (peak, first)


class _QuotaStorage(LocalStorage):
    """A local disk of ``quota`` bytes: a write past it fails with ENOSPC (as the real ones)."""

    def __init__(self, root: str, quota: int) -> None:
        super().__init__(root, fsync=False)
        self.quota = quota

    def used(self) -> int:
        """The bytes of the files under the root. The two pack writers run at once: a file
        listed here may be another writer's temporary, renamed before it is measured (it then
        counts under its new name if the walk meets it, else not: the quota is approximate)."""
        total = 0
        for folder, _, names in os.walk(self.root):  # a folder that vanishes is skipped
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(folder, name)).st_size
        return total

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        if self.used() + len(data) > self.quota:
            with translate_errors(f"writing {path} (quota)"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().put(path, data, overwrite=overwrite)


def test_a_full_disk_recovers_after_gc(local_url: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=g)
    storage = _QuotaStorage(local_url, quota=6 * w.numel() * 4)
    # One writer, nothing in flight elsewhere: gc may sweep at once (min_object_age_s=0).
    with small_store(storage, chunk_size=16384, full_every=1, min_object_age_s=0) as store:
        saved = {}
        with pytest.raises(StorageError, match="disk full"):
            for step in range(20):
                w = w + torch.randn(w.shape, generator=g)
                saved[step] = {"w": w.clone()}
                store.save(saved[step], step).wait()
        failed = step
        assert failed not in store.steps()
        store.gc(keep_last=1)
        assert store.save(saved[failed], failed).wait()
        assert_state_equal(store.load(), saved[failed])
    # and with keep_last the same disk never fills
    with small_store(storage, chunk_size=16384, keep_last=2, min_object_age_s=0) as store:
        for step in range(100, 130):
            w = w + torch.randn(w.shape, generator=g)
            store.save({"w": w}, step).wait()
        assert_state_equal(store.load(), {"w": w})


class _RecordingStorage(LocalStorage):
    """A local disk whose subclass overrides ``put``: it must see every object written."""

    def __init__(self, root: str) -> None:
        super().__init__(root, fsync=False)
        self.puts: dict[str, bytes] = {}

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        self.puts[path] = bytes(data)
        return super().put(path, data, overwrite=overwrite)


@pytest.mark.parametrize("override", [False, True])
def test_packs_are_named_by_the_hash_of_their_parts(local_url: str, override: bool) -> None:
    """Packs are written part by part (no joined copy) and named by the streamed hash of the
    parts: the name is the hash of the file's bytes, and a ``put`` of a subclass still sees
    every pack (fault injection, quotas)."""
    storage = _RecordingStorage(local_url) if override else LocalStorage(local_url, fsync=False)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(3000, generator=g) for i in range(6)}
    with small_store(storage, chunk_size=4096, pack_size=40000) as store:
        store.save(state, 0).wait()
        assert store.verify(0).ok
        packs = [p for p in storage.list("") if mf.is_pack_path(p)]
        assert len(packs) >= 2
        for path in packs:
            data = storage.get(path)
            assert mf.pack_path(chunk_hash(data)) == path
        tables = store.manifest(0).chunks
        assert max(sum(1 for c in tables.values() if c.pack == p) for p in packs) >= 2
        if override:
            assert set(packs) <= set(storage.puts)
            assert all(storage.puts[p] == storage.get(p) for p in packs)
        assert_state_equal(store.load(), state)


# ---------------------------------------------------------------- the small items


def test_steps_beyond_twenty_digits_are_refused(local_url: str) -> None:
    with small_store(local_url) as store:
        with pytest.raises(StepError, match=r"10\*\*20"):
            store.save({"x": 1}, 10**20)
        store.save({"x": 1}, 10**20 - 1).wait()
        assert store.steps() == [10**20 - 1]
        assert store.load() == {"x": 1}


def test_deep_nesting_is_a_typed_error_naming_the_key_path(local_url: str) -> None:
    state: dict[str, Any] = {"leaf": torch.ones(2)}
    for _ in range(600):
        state = {"a": state}
    with small_store(local_url) as store:
        with pytest.raises(UnsupportedValueError, match=r"state\['a'\]\['a'\].*nested 100"):
            store.save(state, 1)
        store.save({"ok": 1}, 1).wait()  # the refused step is free again


@pytest.mark.parametrize("depth", [400, 5000])
def test_a_deeply_nested_forged_manifest_is_refused(local_url: str, depth: int) -> None:
    """A manifest with a valid checksum whose skeleton nests ``depth`` lists: too deep for the
    JSON parser (5000) or for rebuilding the state (400). Either way a typed error, and load()
    falls back."""
    with small_store(local_url) as store:
        store.save({"x": 1}, 1).wait()
        store.save({"x": 2}, 2).wait()
        doc = store.manifest(2).to_dict()
    deep = '["l",[' * depth + "1" + "]]" * depth

    def text(body: dict[str, Any]) -> str:
        return json.dumps({**body, "tree": "@TREE@"}, sort_keys=True, separators=(",", ":"))

    checksum = chunk_hash(text(doc).replace('"@TREE@"', deep).encode())
    forged = text({**doc, "checksum": checksum}).replace('"@TREE@"', deep)
    Path(local_url, *mf.manifest_path(2).split("/")).write_text(forged)
    with small_store(local_url) as store:
        with pytest.raises(ManifestError, match="nested too deeply"):
            store.load(2)
        with pytest.warns(UserWarning, match="step 2 .* unusable"):
            assert store.load() == {"x": 1}


def _forge_absurd(local_url: str, single_chunk: bool) -> None:
    """Rewrite the newest manifest (step 2) with a valid checksum and one more tensor, of a few
    TiB: one chunk claiming them all, or the largest chunk a manifest may name, repeated (a
    chunk may repeat: an all-zero tensor's does)."""
    path = Path(local_url, *mf.manifest_path(2).split("/"))
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    recipe = next(r for r in doc["chunks"].values() if r.get("base") is None)
    digest = "0" * 32
    size = 1 << 42 if single_chunk else 1 << 30
    doc["chunks"][digest] = dict(recipe, size=size)
    doc["tensors"].append(
        dict(
            doc["tensors"][0],
            path="state['big']",
            dtype="float32",
            numpy=False,
            shape=[1 << 40],
            nbytes=1 << 42,
            chunks=[digest] * ((1 << 42) // size),
        )
    )
    path.write_bytes(canonical.sign(doc))


@pytest.mark.parametrize("single_chunk", [True, False], ids=["huge-chunk", "many-chunks"])
def test_an_absurd_shape_falls_back_and_verifies_as_damaged(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], single_chunk: bool
) -> None:
    run = states(2)
    with small_store(local_url) as store:
        for step in (0, 1):
            store.save(run[step], step + 1).wait()
    _forge_absurd(local_url, single_chunk)
    with small_store(local_url) as store:
        with pytest.warns(UserWarning, match="step 2 .* unusable"):
            assert_state_equal(store.load(), run[0])
        with pytest.raises(CorruptCheckpointError):
            store.load(2)
        assert not store.verify(2).ok
    capsys.readouterr()
    assert main(["verify", local_url]) == 1
    assert main(["export", local_url, "--to", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 2" in err


def test_stale_temporary_manifests_are_swept(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save({"x": torch.ones(4)}, 1).wait()
        old = Path(local_url, "manifests", ".tmp-0123abcd")
        fresh = Path(local_url, "manifests", ".tmp-4567ef01")
        for f in (old, fresh):
            f.write_bytes(b"{partial")
        then = time.time() - STALE_TMP_S - 60
        os.utime(old, (then, then))
        report = store.gc()
        assert "manifests/.tmp-0123abcd" in report.removed_objects
        assert not old.exists() and fresh.exists()
        assert store.steps() == [1]
