"""Fresh snapshot buffers in huge pages: a first save's copy takes one page fault per 2 MiB, not
one per 4 KiB. What the kernel granted is read from ``/proc/self/smaps`` (the mapping holding a
buffer, its ``AnonHugePages``); the rest checks that such buffers behave as any other: exact
bytes, recycled by the pool, freed with their last tensor."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.buffers import (
    HUGE_MIN,
    HUGE_PAGES_ENV,
    BufferPool,
    host_empty,
    host_tensor,
)
from lightning_incremental.core.save.snapshot import flatten_state, wait_ready

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    """``always``, ``madvise`` (huge pages on request) or ``never``; ``never`` without THP."""
    try:
        return THP.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


needs_thp = pytest.mark.skipif(_thp_mode() == "never", reason="no transparent huge pages here")
on_request = pytest.mark.skipif(
    _thp_mode() != "madvise", reason="the kernel does not give huge pages on request only"
)


def _huge_kb(tensor: torch.Tensor) -> int | None:
    """``AnonHugePages`` (kB) of the mapping holding ``tensor``'s first byte; None if not found."""
    address = tensor.data_ptr()
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if start <= address < end:
            match = re.search(r"^AnonHugePages:\s+(\d+) kB", block, re.M)
            return int(match.group(1)) if match else 0
    return None


@needs_thp
def test_a_fresh_snapshot_of_many_small_tensors_lies_in_huge_pages() -> None:
    """The slab of 4,096 tensors of 4 KiB (16 MiB): faulted in as huge pages (before: torch's
    allocator, 4 KiB pages, none huge where the kernel grants them only on request)."""
    state = {"m": {f"w{i}": torch.full((1024,), float(i)) for i in range(4096)}}
    snap = flatten_state(state, pool=BufferPool())
    wait_ready(snap)
    leaf = snap.leaves[0]
    assert leaf is not None
    slab = leaf.slab  # type: ignore[attr-defined]
    assert slab.numel() * slab.element_size() == 16 << 20
    assert (_huge_kb(slab) or 0) >= 2048, "the slab is not in huge pages"
    assert torch.equal(leaf.data, state["m"]["w0"])


@needs_thp
def test_a_fresh_copy_of_a_big_tensor_lies_in_huge_pages() -> None:
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    snap = flatten_state({"big": big}, pool=BufferPool())
    wait_ready(snap)
    (leaf,) = [leaf for leaf in snap.leaves if leaf is not None]
    assert (_huge_kb(leaf.data) or 0) >= 2048
    assert torch.equal(leaf.data, big)


@on_request
def test_the_switch_and_small_buffers_keep_plain_pages(monkeypatch) -> None:
    """Turned off, or under ``HUGE_MIN``, a buffer comes from torch's allocator: plain pages
    (where the kernel grants huge ones only on request); on, huge pages."""
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    off = host_empty(8 << 20).fill_(1)
    monkeypatch.delenv(HUGE_PAGES_ENV)
    small = host_empty(HUGE_MIN - 4096).fill_(1)
    on = host_empty(8 << 20).fill_(1)
    assert _huge_kb(off) == 0
    assert _huge_kb(small) == 0
    assert (_huge_kb(on) or 0) >= 2048


def test_host_tensors_of_every_shape_and_dtype_hold_what_is_copied_in() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        src = torch.randn(3, HUGE_MIN // 8 + 5).to(dtype)
        out = host_tensor(src.shape, dtype)
        assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous()
        out.copy_(src)
        assert torch.equal(out, src)


def test_the_pool_recycles_a_huge_page_buffer() -> None:
    pool = BufferPool()
    first = pool.take(torch.Size([HUGE_MIN // 4]), torch.float32)
    address = first.data_ptr()
    pool.give([first])
    again = pool.take(torch.Size([HUGE_MIN // 2]), torch.bfloat16)
    assert again.data_ptr() == address


def _mapping(address: int) -> tuple[int, int] | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return start, end
    return None


def test_a_huge_page_buffer_is_unmapped_with_its_last_tensor() -> None:
    buffer = host_empty(HUGE_MIN + 4096)
    view = buffer[4096:].view(torch.int32)
    address = buffer.data_ptr()
    mapped = _mapping(address)
    assert mapped is not None and mapped[0] <= address  # a mapping the buffer lies in
    assert mapped[1] >= address + HUGE_MIN + 4096
    del buffer
    gc.collect()
    assert _mapping(address) == mapped  # a view still holds it
    del view
    gc.collect()
    assert _mapping(address) != mapped


def test_a_store_round_trips_states_held_in_huge_pages(tmp_path: Path) -> None:
    state = {
        "big": torch.randn(HUGE_MIN // 4 + 3),
        "small": {f"s{i}": torch.randn(1000) for i in range(2000)},
    }
    with CheckpointStore(tmp_path / "s") as store:
        for step in (1, 2, 3):
            state["big"].add_(1)
            state["small"]["s7"].mul_(2)
            store.save(state, step).wait()
        back = store.load()
    assert torch.equal(back["big"], state["big"])
    assert all(torch.equal(back["small"][k], v) for k, v in state["small"].items())
