"""Fresh snapshot buffers in huge pages, where they are turned on
(``LIGHTNING_INCREMENTAL_HUGE_PAGES=1``): a first save's copy takes one page fault per 2 MiB, not
one per 4 KiB. Off by default: where the kernel compacts memory on the spot for them, a fault
can cost many times a 4 KiB page's (see :mod:`lightning_incremental.core.buffers`). What the
kernel granted is read from ``/proc/self/smaps`` (the mapping holding a buffer, its
``AnonHugePages``); the rest checks that such buffers behave as any other: exact bytes,
recycled by the pool, freed with their last tensor, and that a fresh slab is faulted in before
the copy."""

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
from lightning_incremental.core.save.slabs import BATCH_FIRST
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


@pytest.fixture
def huge_pages_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")


@needs_thp
def test_a_fresh_snapshot_of_many_small_tensors_lies_in_huge_pages(huge_pages_on: None) -> None:
    """Turned on, the slabs of 4,096 tensors of 4 KiB (of 2, 4, 8 and 2 MiB: the first three
    copied on the copying thread) are faulted in as huge pages where at least ``HUGE_MIN``
    (torch's allocator gives 4 KiB pages, none huge where the kernel grants them only on
    request)."""
    state = {"m": {f"w{i}": torch.full((1024,), float(i)) for i in range(4096)}}
    snap = flatten_state(state, pool=BufferPool())
    wait_ready(snap)
    first = 3 * BATCH_FIRST  # the first tensor of the third batch
    leaf = snap.leaves[first]
    assert leaf is not None
    slab = leaf.slab  # type: ignore[attr-defined]
    assert slab.numel() * slab.element_size() == 4 * BATCH_FIRST * 4096 == 8 << 20
    assert (_huge_kb(slab) or 0) >= 2048, "the slab is not in huge pages"
    assert torch.equal(leaf.data, state["m"][f"w{first}"])


@needs_thp
def test_a_fresh_copy_of_a_big_tensor_lies_in_huge_pages(huge_pages_on: None) -> None:
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    snap = flatten_state({"big": big}, pool=BufferPool())
    wait_ready(snap)
    (leaf,) = [leaf for leaf in snap.leaves if leaf is not None]
    assert (_huge_kb(leaf.data) or 0) >= 2048
    assert torch.equal(leaf.data, big)


@on_request
def test_huge_pages_are_off_by_default_and_small_buffers_keep_plain_pages(monkeypatch) -> None:
    """By default, turned off, or under ``HUGE_MIN``, a buffer comes from torch's allocator:
    plain pages (where the kernel grants huge ones only on request); turned on, huge pages."""
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    default = host_empty(8 << 20).fill_(1)
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    off = host_empty(8 << 20).fill_(1)
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    small = host_empty(HUGE_MIN - 4096).fill_(1)
    on = host_empty(8 << 20).fill_(1)
    assert _huge_kb(default) == 0
    assert _huge_kb(off) == 0
    assert _huge_kb(small) == 0
    assert (_huge_kb(on) or 0) >= 2048


def _page_faults_of_a_copy_into(buffer: torch.Tensor) -> int:
    """Minor page faults the process takes while ``buffer`` is filled."""
    import resource

    src = torch.ones(buffer.numel(), dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer.copy_(src)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(
    _thp_mode() == "always", reason="every fresh buffer may come in huge pages: few faults"
)
def test_a_fresh_slab_is_faulted_in_before_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh slab comes resident (zeroed on torch's intra-op threads), so the slab's copy of
    thousands of small tensors takes no page fault of its own; a plain fresh buffer does."""
    import resource

    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    nbytes = 64 << 20  # torch's allocator maps a buffer this large on its own
    pages = nbytes // resource.getpagesize()
    slab = BufferPool().lend_slab(nbytes, [nbytes])
    assert int(slab.count_nonzero()) == 0
    assert _page_faults_of_a_copy_into(slab) < pages // 100
    assert _page_faults_of_a_copy_into(host_empty(nbytes)) > pages // 2


def test_host_tensors_of_every_shape_and_dtype_hold_what_is_copied_in() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        src = torch.randn(3, HUGE_MIN // 8 + 5).to(dtype)
        out = host_tensor(src.shape, dtype)
        assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous()
        out.copy_(src)
        assert torch.equal(out, src)


def test_the_pool_recycles_a_huge_page_buffer(huge_pages_on: None) -> None:
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


def test_a_huge_page_buffer_is_unmapped_with_its_last_tensor(huge_pages_on: None) -> None:
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


def test_a_store_round_trips_states_held_in_huge_pages(tmp_path: Path, huge_pages_on: None) -> None:
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
