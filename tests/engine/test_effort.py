"""``codec_effort``: how much CPU a save spends to write fewer bytes. ``"fast"`` stores changed
chunks as they are (codec ``s``); ``"auto"`` does so only after a save whose background thread
waited longer for a CPU than it ran (training holds every core), or while saves
are asked for faster than a save coded in full ends, and codes in full again once neither is
so. Every checkpoint restores bit-exact whichever way it was coded."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core.chunks import encode as encoder
from lightning_incremental.core.commit import effort as effort_module
from lightning_incremental.core.commit.effort import MIN_BEHIND_S, PROBE_EVERY, Effort
from tests.conftest import small_store


def _training(seed: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "moving": torch.randn(6000, generator=g),
        "frozen": torch.randn(6000, generator=g),
        "opt": torch.randn(6000, generator=g).abs(),
    }

    def step() -> None:
        state["moving"].add_(torch.randn(6000, generator=g) * 1e-3)
        state["opt"].mul_(0.999).add_(1e-6)

    return state, step


def _kinds(store: CheckpointStore, step: int) -> dict[str, set[str]]:
    manifest = store.manifest(step)
    return {
        t.path: {manifest.chunks[d].kind for d in t.chunks if d in manifest.chunks}
        for t in manifest.tensors
    }


def test_fast_stores_changed_chunks_as_they_are_and_restores_exactly(local_url: str) -> None:
    state, step = _training()
    saved = {}
    with small_store(local_url, codec_effort="fast") as store:
        for s in (1, 2, 3):
            result = store.save(state, s).wait()
            saved[s] = {k: v.clone() for k, v in state.items()}
            assert result.effort == "fast"
            step()
        kinds = _kinds(store, 3)
        assert kinds["state['moving']"] == {"s"}
        assert result.chunks_reused >= 6000 * 4 // 4096  # "frozen" is referenced, not written
        for s, expected in saved.items():
            assert store.verify(s).ok
            loaded = store.load(s)
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), (s, key)


def test_fast_writes_more_bytes_and_full_fewer(local_url: str) -> None:
    written = {}
    for effort in ("full", "fast"):
        state, step = _training()
        with small_store(f"{local_url}-{effort}", codec_effort=effort) as store:
            store.save(state, 1).wait()
            step()
            written[effort] = store.save(state, 2).wait().bytes_written
    assert written["fast"] > written["full"]


def test_auto_follows_whether_the_last_save_waited_for_a_cpu(
    local_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The encoding thread's CPU times as the kernel would report them: during each save it
    runs 0.1 s and waits ``waits[i]`` s for a CPU."""
    waits = iter([0.5, 0.5, 0.0, 0.05, 0.0])  # contended, contended, free, free, free
    clock = {"run": 0.0, "wait": 0.0, "calls": 0}

    def cpu_times() -> tuple[float, float]:
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:  # the end of a save's encoding
            clock["run"] += 0.1
            clock["wait"] += next(waits)
        return clock["run"], clock["wait"]

    monkeypatch.setattr(encoder, "cpu_times", cpu_times)
    caplog.set_level(logging.INFO, logger="lightning_incremental")
    state, step = _training()
    efforts = []
    with small_store(local_url, codec_effort="auto") as store:
        for s in range(1, 6):
            efforts.append(store.save(state, s).wait().effort)
            step()
    # save 1 measured contended: save 2 fast (contended too), 3 fast (measured free), 4 coded
    # ("full", or "paced" where the disk took some chunks faster than the codec: test_pace.py)
    coded = ["fast" if e == "fast" else "coded" for e in efforts]
    assert coded == ["coded", "fast", "fast", "coded", "coded"]
    assert "changed chunks are stored as they are" in caplog.text
    assert "coded in full again" in caplog.text


def test_full_never_switches(local_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(encoder, "cpu_times", lambda: (0.0, float(next(clock))))  # always waits
    state, step = _training()
    with small_store(local_url, codec_effort="full") as store:
        for s in range(1, 4):
            assert store.save(state, s).wait().effort == "full"
            step()


def test_a_bad_effort_is_refused(local_url: str) -> None:
    with pytest.raises(ConfigError, match="codec_effort must be one of auto, full, fast"):
        CheckpointStore(local_url, codec_effort="turbo")


def test_effort_behind_when_a_save_is_asked_for_before_a_full_one_ended() -> None:
    """Back-pressure: saves asked for faster than a save coded in full ends are stored as they
    are; every PROBE_EVERY-th is coded in full again, and once one keeps up, full it stays."""
    effort = Effort()
    efforts = []

    def save(busy: bool, seconds: float) -> None:
        effort.started(busy=busy)
        fast = effort.fast()
        efforts.append("fast" if fast else "full")
        effort.observe(fast=fast, seconds=seconds, cpu_run_s=0.0, cpu_wait_s=0.0)

    save(busy=False, seconds=0.5)  # the first: full
    for _ in range(PROBE_EVERY):
        save(busy=True, seconds=0.1)  # asked for while the one before ran: fast
    save(busy=True, seconds=0.5)  # the probe: full
    save(busy=True, seconds=0.1)  # asked for while the probe ran: behind still, fast
    assert efforts == ["full", *["fast"] * PROBE_EVERY, "full", "fast"]
    for _ in range(PROBE_EVERY - 1):
        save(busy=False, seconds=0.1)
    save(busy=False, seconds=0.5)  # the probe keeps up ...
    save(busy=False, seconds=0.5)  # ... so full from now on
    assert efforts[-3:] == ["fast", "full", "full"]


def test_a_short_save_never_counts_as_behind() -> None:
    """Tiny saves asked for back to back (tests, small states) are not what holds training up."""
    effort = Effort()
    for _ in range(5):
        effort.started(busy=True)
        assert not effort.fast()
        effort.observe(fast=False, seconds=MIN_BEHIND_S / 2, cpu_run_s=0.0, cpu_wait_s=0.0)


def test_a_store_behind_its_saves_stores_the_next_one_as_is(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage slow enough that save 2 is asked for while save 1 (full) still writes."""
    from lightning_incremental.core.storage import open_storage
    from tests.faulty import FaultyStorage

    monkeypatch.setattr(effort_module, "MIN_BEHIND_S", 0.0)
    faulty = FaultyStorage(open_storage(local_url, None))
    state, step = _training()
    with CheckpointStore(
        faulty, chunk_size=4096, pack_size=16384, max_in_flight=2, min_object_age_s=0
    ) as store:
        assert store.save(state, 1).wait().effort != "fast"  # measured: a full save's time
        step()
        gate = faulty.hold("pack")
        chosen = threading.Event()  # save 2's encoding chose its effort
        original = Effort.fast
        monkeypatch.setattr(Effort, "fast", lambda self: (chosen.set(), original(self))[1])
        second = store.save(state, 2)
        assert chosen.wait(30)
        step()
        third = store.save(state, 3)  # asked for while save 2 (full) still writes
        gate.set()
        assert second.wait().effort != "fast"
        assert third.wait().effort == "fast"
        assert torch.equal(store.load(3)["moving"], state["moving"])
        assert store.verify(3).ok
