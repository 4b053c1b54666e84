"""Paced saves (``codec_effort="auto"``): a changed chunk is coded in full only while its coding
ends before the writers run out of work, else stored as it is. The codec's and the storage's
speeds are made unequal on purpose here: a storage that takes its time over each pack, or a
codec that does; every checkpoint restores bit-exact whichever way its chunks were coded."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.chunks import encode as encoder
from lightning_incremental.core.chunks import packs as packs_module
from lightning_incremental.core.chunks.pace import PACE_FROM, RELEARN, SMOOTHING, Pacer
from lightning_incremental.core.errors import StorageError
from lightning_incremental.core.storage import open_storage
from tests.conftest import assert_state_equal
from tests.faulty import FaultyStorage, SlowStorage

CHUNK = 16 << 10
OPTIONS: dict[str, Any] = {"chunk_size": CHUNK, "pack_size": 4 * CHUNK, "min_object_age_s": 0}


def _states(n: int, seed: int = 0, step: float | None = None) -> list[dict[str, torch.Tensor]]:
    """``n`` states of 48 chunks each, every chunk changed: new random values (dense float32
    noise, which the codec shrinks little), or a small ``step`` from the last (which it
    shrinks to a fraction)."""
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(12 * CHUNK // 4, generator=g) for i in range(4)}
    out = []
    for _ in range(n):
        if step is None:
            state = {k: torch.randn(v.shape, generator=g) for k, v in state.items()}
        else:
            state = {k: v + step * torch.randn(v.shape, generator=g) for k, v in state.items()}
        out.append(state)
    return out


@pytest.fixture(autouse=True)
def no_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The saves' CPU waits are not measured: on a loaded machine ``auto`` would otherwise
    store a save whose thread waited for a CPU as it is (``"fast"``, test_effort.py), whatever
    the pacing these tests look at."""
    monkeypatch.setattr(encoder, "cpu_times", lambda: None)


@pytest.fixture
def slow_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Coding a chunk in full takes 20 ms longer (storing it as it is does not): a codec
    slower than the storage."""
    original = encoder._encode_task

    def slow(task: Any, level: int, ratio: float, fast: bool = False) -> Any:
        if not fast:
            time.sleep(0.02)
        return original(task, level, ratio, fast)

    monkeypatch.setattr(encoder, "_encode_task", slow)


def _stored_as_is(store: CheckpointStore, step: int, before: set[str]) -> int:
    """Chunks of ``step`` written by its own save (not in ``before``) and stored as they are."""
    doc = store.manifest(step)
    return sum(1 for d, r in doc.chunks.items() if d not in before and r.kind == "s")


def _save_all(store: CheckpointStore, states: list[dict[str, torch.Tensor]]) -> list[Any]:
    results, seen = [], set()
    for step, state in enumerate(states, 1):
        result = store.save(state, step).wait()
        assert result.chunks_as_is == _stored_as_is(store, step, seen)
        seen |= set(store.manifest(step).chunks)
        results.append(result)
    for step, state in enumerate(states, 1):
        assert_state_equal(store.load(step), state)
        assert store.verify(step).ok
    return results


def test_a_storage_slower_than_the_codec_gets_every_chunk_coded(local_url: str) -> None:
    storage = SlowStorage(open_storage(local_url, None), 0.03, "packs/")  # slower than any codec
    with CheckpointStore(storage, **OPTIONS) as store:
        results = _save_all(store, _states(3))
    assert [r.effort for r in results] == ["full"] * 3
    assert all(r.chunks_as_is == 0 for r in results)
    assert all(r.chunks_full + r.chunks_delta == 48 for r in results[1:])


def test_chunks_the_codec_shrinks_well_are_coded_whatever_the_disk(slow_codec: None) -> None:
    """Small steps: each chunk's XOR delta codes to a fraction of its bytes (under
    ``PACE_FROM``), so every chunk is coded though the codec is the slower."""
    with CheckpointStore("memory://li-test-pace-shrinks", **OPTIONS) as store:
        results = _save_all(store, _states(3, step=1e-6))
    # The first save's random values shrink little: paced (see the next test).
    assert [(r.effort, r.chunks_as_is) for r in results[1:]] == [("full", 0)] * 2
    assert all(r.chunks_delta == 48 for r in results[1:])
    assert results[-1].bytes_written < results[-1].bytes_logical * PACE_FROM


def test_a_codec_slower_than_the_storage_stores_what_it_cannot_keep_up_with(
    slow_codec: None,
) -> None:
    states = _states(4)
    with CheckpointStore("memory://li-test-pace-slow-codec", **OPTIONS) as store:
        results = _save_all(store, states)
        store_docs = {step: store.manifest(step) for step in (1, 2)}
    with CheckpointStore(
        "memory://li-test-pace-slow-codec-full", codec_effort="full", **OPTIONS
    ) as full:
        coded = _save_all(full, states)
    # New random values shrink little, standalone (the first save) or as deltas (the next): a
    # tensor's first chunks are coded (how well the codec shrinks the tensor is learnt), and
    # from then on its chunks are paced like the places coded before. The writers wait.
    for step, (paced, every) in enumerate(zip(results, coded, strict=True), 1):
        assert paced.effort == "paced" and every.effort == "full"
        low = 24 if step > 2 else 4  # the first two: chunks wait for a tensor's first
        assert low <= paced.chunks_as_is <= 44, step  # at most: all but each tensor's first
        assert paced.chunks_full + paced.chunks_delta == 48  # every chunk changed, written once
        assert paced.bytes_written > every.bytes_written
    for step in (1, 2):
        doc = store_docs[step]
        firsts = [doc.chunks[t.chunks[0]] for t in doc.tensors]
        assert all(first.kind != "s" for first in firsts), step
    # Before a save's first pack is handed over nothing says the writers wait: its first
    # changed chunk is coded (a save of a few changed chunks is coded in full).
    assert all(r.chunks_as_is <= 47 for r in results)


def test_the_first_pack_of_a_paced_save_is_small(
    slow_codec: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is handed over at ``TAIL_PACK`` (2 MiB: one chunk of the default 4 MiB), so that
    the writers start sooner; one chunk here."""
    monkeypatch.setattr(packs_module, "TAIL_PACK", CHUNK // 2)
    state = _states(1)[0]
    with CheckpointStore("memory://li-test-pace-first", **OPTIONS) as store:
        store.save(state, 1).wait()
        doc = store.manifest(1)
    first = doc.chunks[doc.tensors[0].chunks[0]]
    assert first.kind != "s", "the first chunk is coded"
    assert doc.packs[first.pack] == first.length, "and handed over alone"


def test_a_save_of_one_changed_chunk_is_coded_whatever_the_disk(slow_codec: None) -> None:
    state = _states(1)[0]
    with CheckpointStore("memory://li-test-pace-one", **OPTIONS) as store:
        store.save(state, 1).wait()
        state = {k: v.clone() for k, v in state.items()}
        state["w2"][:10] += 1.0
        result = store.save(state, 2).wait()
        assert (result.chunks_delta, result.chunks_full, result.effort) == (1, 0, "full")
        assert_state_equal(store.load(2), state)


def test_full_and_fast_are_never_paced(slow_codec: None) -> None:
    states = _states(2)
    for effort, as_is in (("full", 0), ("fast", 48)):
        url = f"memory://li-test-pace-{effort}"
        with CheckpointStore(url, codec_effort=effort, **OPTIONS) as store:
            results = _save_all(store, states)
        assert [r.chunks_as_is for r in results] == [as_is, as_is]
        assert {r.effort for r in results} == {effort}


def test_a_member_of_a_shared_pool_is_never_paced(tmp_path: Path, slow_codec: None) -> None:
    """Its packs must be the same bytes in two runs that store the same tensors (the pool holds
    them once): how a chunk is coded cannot depend on timing there."""
    with CheckpointStore(tmp_path / "a", pool=tmp_path / "pool", **OPTIONS) as store:
        results = _save_all(store, _states(4))  # the last two would be paced (see above)
    assert [(r.effort, r.chunks_as_is) for r in results] == [("full", 0)] * 4


def test_a_failed_write_in_a_paced_save_commits_nothing(local_url: str, slow_codec: None) -> None:
    faulty = FaultyStorage(open_storage(local_url, None))
    states = _states(4)
    with CheckpointStore(faulty, **OPTIONS) as store:
        store.save(states[0], 1).wait()
        store.save(states[1], 2).wait()  # the places' ratios are known from here on
        faulty.fail("pack", nth=3)
        with pytest.raises(StorageError):
            store.save(states[2], 3).wait()
        assert store.steps() == [1, 2]
        result = store.save(states[3], 4).wait()
        assert result.effort == "paced"
    with CheckpointStore(local_url, **OPTIONS) as fresh:
        assert fresh.steps() == [1, 2, 4]
        assert_state_equal(fresh.load(4), states[3])
        assert fresh.verify(4).ok


def test_a_writer_reports_what_is_left_to_write(local_url: str) -> None:
    """``unwritten`` counts the bytes handed over and not written, failed writes included."""
    faulty = FaultyStorage(open_storage(local_url, None))
    gate = faulty.hold("pack")
    pacer = Pacer(workers=1, writers=2)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        out = encoder.Encoded(tensors=[], chunks={}, packs={})
        writer = packs_module.PackWriter(faulty, pool, 1 << 20, out, 0, pacer=pacer)
        assert not writer.waiting()  # nothing handed over yet: not waiting, coding
        writer.add("a" * 32, b"x" * 1000, {"kind": "s", "size": 1000, "width": 1})
        writer.flush()
        assert writer.unwritten == 1000 and not writer.waiting()
        gate.set()
        writer.wait()
        assert writer.unwritten == 0 and writer.waiting()
        assert pacer.write_bps is not None and pacer.write_bps > 0
        faulty.fail("pack")
        writer.add("b" * 32, b"y" * 500, {"kind": "s", "size": 500, "width": 1})
        writer.flush()
        with pytest.raises(StorageError):
            writer.wait()
        assert writer.unwritten == 0


def test_chunks_coded_whatever_the_writers_do_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lossy chunks are coded even while the writers wait (for them there is no "as it is"):
    the scheduling thread still waits for the encoders once ``PACED_AHEAD`` times the window's
    limit are being coded, instead of queueing a whole tensor's chunks."""
    original = encoder._encode_task

    def slow_lossy(task: Any, level: int, ratio: float, fast: bool = False) -> Any:
        if task.lossy is not None:
            time.sleep(0.005)
        return original(task, level, ratio, fast)

    monkeypatch.setattr(encoder, "_encode_task", slow_lossy)
    g = torch.Generator().manual_seed(0)
    state = {"m": torch.randn(64 * CHUNK // 4, generator=g).abs(), "w": torch.randn(4096)}
    url = "memory://li-test-pace-lossy"
    with CheckpointStore(url, workers=2, lossy_codecs={"state['m']": "b16"}, **OPTIONS) as store:
        pool = store._engine.pool
        submit, outstanding, most = pool.submit, [0], [0]

        def counted(fn: Any, *args: Any) -> Any:
            outstanding[0] += 1
            most[0] = max(most[0], outstanding[0])
            future = submit(fn, *args)
            future.add_done_callback(lambda _: outstanding.__setitem__(0, outstanding[0] - 1))
            return future

        monkeypatch.setattr(pool, "submit", counted)
        store.save(state, 1).wait()
        state["m"].mul_(1.01)
        store.save(state, 2).wait()
        loaded = store.load(2)
    assert most[0] <= encoder.PACED_AHEAD * 2 * 2 + 1, most[0]
    assert torch.equal(loaded["w"], state["w"])
    assert torch.allclose(loaded["m"], state["m"], rtol=1e-2)


# ---------------------------------------------------------------------------- the rule


def test_nothing_measured_codes() -> None:
    assert Pacer(2, 2).code(nbytes=4 << 20, coding=0, unwritten=0, ratio=0.9)


def test_writers_with_nothing_to_write_are_never_kept_waiting() -> None:
    pacer = Pacer(1, 1)
    pacer.coded(1 << 20, 0.001)  # a fast codec
    pacer.wrote(1 << 20, 1.0)  # a slow disk
    assert not pacer.code(nbytes=1 << 20, coding=0, unwritten=0, ratio=0.9)
    assert pacer.code(nbytes=1 << 20, coding=0, unwritten=1 << 20, ratio=0.9)


def test_a_place_is_paced_only_once_its_codec_shrank_it_little() -> None:
    pacer = Pacer(1, 1)
    pacer.coded(1 << 20, 10.0)  # a codec far slower than the disk
    pacer.wrote(1 << 20, 0.001)
    place = ("state['w']", 3)
    assert pacer.ratio(place) is None
    assert pacer.code(nbytes=1 << 20, coding=0, unwritten=0, ratio=pacer.ratio(place))
    pacer.coded(1 << 20, 10.0, place, int(0.2 * (1 << 20)))  # shrank to a fifth
    assert pacer.code(nbytes=1 << 20, coding=0, unwritten=0, ratio=pacer.ratio(place))
    pacer.coded(1 << 20, 10.0, place, int(0.9 * (1 << 20)))  # dense noise
    assert not pacer.code(nbytes=1 << 20, coding=0, unwritten=0, ratio=pacer.ratio(place))
    assert pacer.ratio(place, delta=True) is None  # a delta's ratio is learnt apart
    for _ in range(RELEARN):  # stored as it is RELEARN times: measured anew
        assert pacer.ratio(place) == pytest.approx(0.9)
        pacer.stored(place)
    assert pacer.ratio(place) is None
    pacer.coded(1 << 20, 10.0, place, int(0.9 * (1 << 20)))
    assert pacer.ratio(place) == pytest.approx(0.9)
    pacer.forget_except({"state['other']"})
    assert pacer.ratio(place) is None


def test_a_place_never_coded_goes_by_its_tensors_ratio_until_it_is_measured() -> None:
    """A new place is estimated by the ratio its tensor's places last coded to (standalone and
    delta apart, no tensor by another's); stored as it is on that estimate, it is coded and
    measured within RELEARN saves, as a place that was coded is."""
    pacer = Pacer(1, 1)
    first, other = ("state['w']", 0), ("state['w']", 7)
    assert pacer.estimate(other) is None  # nothing known of the tensor: code, to learn
    pacer.coded(1 << 20, 1.0, first, int(0.9 * (1 << 20)))
    assert pacer.estimate(other) == pytest.approx(0.9)
    assert pacer.ratio(other) is None  # its own ratio: still unknown
    assert pacer.estimate(other, delta=True) is None
    assert pacer.estimate(("state['v']", 7)) is None
    saves = 0
    while pacer.estimate(other) is not None:
        pacer.stored(other)
        saves += 1
        assert saves <= RELEARN
    assert saves >= 1
    pacer.coded(1 << 20, 1.0, other, int(0.1 * (1 << 20)))  # measured: it shrinks well
    assert pacer.estimate(other) == pytest.approx(0.1, rel=1e-4)
    assert pacer.estimate(("state['w']", 9)) == pytest.approx(0.1, rel=1e-4)  # the newest
    pacer.forget_except({"state['v']"})
    assert pacer.estimate(("state['w']", 9)) is None


def test_until_a_pack_is_synced_the_writes_alone_give_the_writers_rate() -> None:
    pacer = Pacer(1, 1)
    assert pacer.write_bps is None
    pacer.wrote_unsynced(1000, 0.001)
    assert pacer.write_bps == pytest.approx(1e6)
    pacer.wrote(1000, 1.0)  # to durable: this one counts from now on
    pacer.wrote_unsynced(1000, 0.001)
    assert pacer.write_bps == pytest.approx(1000)


@given(
    code_mbps=st.floats(1, 10_000),
    write_mbps=st.floats(1, 10_000),
    workers=st.integers(1, 16),
    writers=st.integers(1, 4),
    coding=st.integers(0, 32),
    unwritten_mb=st.floats(0, 1024),
    nbytes=st.integers(1, 64 << 20),
)
@settings(max_examples=200, deadline=None)
def test_a_chunk_is_coded_exactly_when_its_coding_ends_before_the_writes(
    code_mbps: float,
    write_mbps: float,
    workers: int,
    writers: int,
    coding: int,
    unwritten_mb: float,
    nbytes: int,
) -> None:
    pacer = Pacer(workers, writers)
    pacer.coded(int(code_mbps * 1e6), 1.0)
    pacer.wrote(int(write_mbps * 1e6), 1.0)
    unwritten = int(unwritten_mb * 1e6)
    coding_s = (coding + 1) * nbytes / (int(code_mbps * 1e6) * workers)
    writing_s = unwritten / (int(write_mbps * 1e6) * writers)
    code = partial(pacer.code, nbytes=nbytes, ratio=PACE_FROM)  # a place the codec shrank little
    assert code(coding=coding, unwritten=unwritten) == (coding_s <= writing_s)
    # Monotone: more queued for the writers never turns coding off, more being coded never on.
    if code(coding=coding, unwritten=unwritten):
        assert code(coding=coding, unwritten=2 * unwritten)
    else:
        assert not code(coding=coding + 1, unwritten=unwritten)
    # A place the codec shrank well, or never coded, is coded whatever the rates.
    assert pacer.code(nbytes=nbytes, coding=coding, unwritten=unwritten, ratio=PACE_FROM / 2)
    assert pacer.code(nbytes=nbytes, coding=coding, unwritten=unwritten, ratio=None)


def test_rates_follow_the_newest_measurements() -> None:
    pacer = Pacer(1, 1)
    pacer.wrote(100, 1.0)
    pacer.wrote(0, 1.0)  # nothing written: no measurement
    pacer.wrote(100, 0.0)
    assert pacer.write_bps == 100
    for _ in range(40):
        pacer.wrote(1000, 1.0)
    assert pacer.write_bps == pytest.approx(1000, rel=1e-3)
    pacer.wrote(0, 0.0)
    pacer.coded(500, 1.0)
    pacer.coded(1500, 1.0)
    assert pacer.code_bps == pytest.approx(500 * (1 - SMOOTHING) + 1500 * SMOOTHING)
    # Weighted by bytes: a small write's fixed cost counts for its bytes, not for a sample.
    fresh = Pacer(1, 1)
    fresh.wrote(16_000_000, 0.016)  # 1 GB/s
    fresh.wrote(2_000_000, 0.012)  # a small pack, mostly its fsync
    bytes_ = 16e6 * (1 - SMOOTHING) + 2e6 * SMOOTHING
    seconds = 0.016 * (1 - SMOOTHING) + 0.012 * SMOOTHING
    assert fresh.write_bps == pytest.approx(bytes_ / seconds)


def test_one_thread_for_coding_and_writing_is_never_paced(slow_codec: None) -> None:
    """``workers=1``: one thread codes and writes, in order, so a chunk's coding never overlaps
    a write; pacing would only trade bytes for nothing."""
    url = "memory://li-test-pace-one-thread"
    with CheckpointStore(url, workers=1, **OPTIONS) as store:
        results = _save_all(store, _states(4))
    assert [(r.effort, r.chunks_as_is) for r in results] == [("full", 0)] * 4
