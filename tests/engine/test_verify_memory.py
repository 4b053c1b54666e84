"""``verify`` and ``gc --keep-last`` (which verifies the checkpoint it keeps) hold a few
read-ahead windows of a checkpoint, not the checkpoint.

Measured by bytes held: tracemalloc's peak over the call, on the memory:// backend, whose reads
are Python bytes (traced; a local store maps large reads instead, which tracemalloc does not
see). The checkpoint is 64 MiB with chains of deltas, verified within a 4 MiB window with
512 KiB chunks and 2 MiB packs: the ratios of the defaults (32 MiB window, 4 MiB chunks, 16 MiB
packs) on a 512 MiB checkpoint.

A window so small that nearly every range is read again gives the very same report as the
default, on a store with damage: the window changes what is held, never what is found.
"""

from __future__ import annotations

import dataclasses
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit.history import read_manifest
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain import verify
from lightning_incremental.core.results import VerifyReport
from tests.conftest import walk_store

MiB = 1 << 20
WINDOW = 4 * MiB
ELEMENTS = 16 * MiB  # float32: 64 MiB


@pytest.fixture(scope="module")
def big_store() -> Iterator[str]:
    """A 64 MiB checkpoint of three steps: a full base, then two sparse updates (XOR deltas on
    every chunk): the newest step's chunks are chains of three links."""
    url = f"memory://li-verify-memory-{uuid.uuid4().hex}"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(ELEMENTS, generator=g)
    # codec_effort="full": under "auto" a save whose thread waited for a CPU longer than it ran
    # (a loaded machine: the suite runs on every core) stores the next one's chunks as they
    # are, without the deltas this checkpoint is made of.
    options: dict[str, Any] = {
        "chunk_size": MiB // 2,
        "pack_size": 2 * MiB,
        "full_every": 100,
        "codec_effort": "full",
    }
    with CheckpointStore(url, max_chain_ratio=100.0, **options) as store:
        for step in (1, 2, 3):
            if step > 1:
                w[torch.arange(step, ELEMENTS, 97)] += 1.0  # every chunk changes a little
            result = store.save({"w": w}, step).wait()
            assert result.full_base == (step == 1)
            assert step == 1 or result.chunks_delta == ELEMENTS * 4 // (MiB // 2)
    del w
    yield url
    fsspec.filesystem("memory").rm(url, recursive=True)


def held_at_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()`` and the most bytes it held at once beyond what was held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = call()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return result, peak


def test_verify_holds_a_few_windows_not_the_checkpoint(big_store: str) -> None:
    with CheckpointStore(big_store) as store:
        doc = store.manifest(3)
        stored = sum(doc.packs.values())
        assert stored > 48 * MiB  # 64 MiB of float32, the base compressed a little
        assert max(r.depth for r in doc.chunks.values()) == 2, "chains of three links"
        report, peak = held_at_peak(
            lambda: verify.verify_manifest(
                store.storage, doc, VerifyReport(step=3), "step 3", read_ahead=WINDOW
            )
        )
    assert report.ok, report
    assert report.bytes_checked == stored
    assert report.chunks_checked == len(doc.chunks)
    assert peak < 3 * WINDOW, (
        f"verify held {peak / MiB:.1f} MiB of a {stored / MiB:.0f} MiB checkpoint"
    )


@pytest.mark.parametrize("maintenance", ["verify", "gc"])
def test_store_verify_and_gc_hold_a_few_windows(
    big_store: str, maintenance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``store.verify()`` and ``gc(keep_last=1)``, whose thorough check of the kept checkpoint
    is the same verification, within the store's window (set here through its default)."""
    monkeypatch.setattr(verify, "READ_AHEAD", WINDOW, raising=False)
    with CheckpointStore(big_store) as store:
        if maintenance == "verify":
            report, peak = held_at_peak(store.verify)
            assert report.ok, report
        else:
            report, peak = held_at_peak(lambda: store.gc(keep_last=1, dry_run=True))
            assert report.kept_steps == [3] and report.removed_steps == [1, 2]
    assert peak < 3 * WINDOW, f"{maintenance} held {peak / MiB:.1f} MiB"


def _report(store: CheckpointStore, step: int, read_ahead: int) -> dict[str, Any]:
    doc = read_manifest(store.storage, step)
    report = verify.verify_manifest(
        store.storage, doc, VerifyReport(step=step), f"step {step}", read_ahead=read_ahead
    )
    return dataclasses.asdict(report)


@pytest.mark.parametrize("how", ["bitflip", "truncate", "delete"])
def test_a_small_window_finds_what_the_default_finds(tmp_path: Path, how: str) -> None:
    """Damage in the middle of the chains: the same objects, chunks and errors are reported,
    in the same order, whether the window holds everything or next to nothing."""
    store, _ = walk_store(str(tmp_path / "store"), steps=5)
    with store:
        doc = store.manifest(5)
        middle = read_manifest(store.storage, 3)
        pack = next(p for p in middle.packs if p in doc.packs and p not in store.manifest(2).packs)
        file = tmp_path.joinpath("store", *pack.split("/"))
        data = bytearray(file.read_bytes())
        if how == "bitflip":
            data[len(data) // 2] ^= 0x08
            file.write_bytes(bytes(data))
        elif how == "truncate":
            file.write_bytes(bytes(data[: len(data) // 3]))
        else:
            file.unlink()
        default = _report(store, 5, verify.READ_AHEAD)
        assert not VerifyReport(**default).ok
        assert default["errors"], "the chunks of the damaged object are named"
        assert all(pack in e or "unreadable" in e for e in default["errors"])
        assert [o["path"] for o in default["objects"] if not o["ok"]] == [pack]
        for window in (1, 4096, 64 * 1024):
            assert _report(store, 5, window) == default
        assert mf.is_pack_path(pack)
