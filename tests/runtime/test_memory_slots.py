"""The memory tier's steps cost one copy of the state: from a rank's second step on, the snapshot
is copied straight into the file of the part it becomes, no bytes of it are written through a
file afterwards, the snapshot pool holds no host buffers, and a part's file is reused once the
part is no longer kept — without ever changing a part that is still visible, and without a crash
when the memory is full."""

from __future__ import annotations

import builtins
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.runtime.memory import tier as memory_tier
from lightning_incremental.runtime.memory.steps import MemoryOptions, MemorySteps
from lightning_incremental.runtime.memory.tier import DATA, MemoryPartError
from tests.conftest import dead_pid


def _steps(path: Path) -> MemorySteps:
    return MemorySteps(
        MemoryOptions(1, 1, str(path)),
        rank=0,
        world_size=1,
        ranks_per_node=1,
        url=str(path / "store"),
        generation=None,
        allow_pickle=False,
        owner="test",
        info=lambda text: None,
        warn=lambda text: warnings.warn(text, stacklevel=2),
    )


def _state(step: int, rows: int = 64) -> dict[str, Any]:
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(rows, 1024), "b": torch.randn(1024)},  # large and small
        "optim": {"step": torch.tensor(float(step)), "m": torch.randn(rows, 1024)},
        "global_step": step,
    }


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


class _Writes:
    """Bytes written through ``open()`` into parts' data files."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        real_open = builtins.open
        counter = self

        class Counted:
            def __init__(self, f: Any) -> None:
                self._f = f

            def write(self, data: Any) -> int:
                counter.bytes += memoryview(data).nbytes
                return int(self._f.write(data))

            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: Any) -> None:
                self._f.close()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._f, name)

        def counting(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(path, mode, *args, **kwargs)
            if str(path).endswith(DATA) and any(m in mode for m in "wa+"):
                return Counted(f)
            return f

        monkeypatch.setattr(builtins, "open", counting)


def _visible(steps: MemorySteps) -> list[str]:
    return sorted(p.name for p in steps.tier.parts.iterdir() if not p.name.startswith("."))


def test_a_step_after_the_first_is_one_copy_into_the_parts_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _Writes(monkeypatch)
    steps = _steps(tmp_path)
    try:
        steps.take(1, _state(1))
        steps.wait()
        first = writes.bytes
        assert first >= 2 * 64 * 1024 * 4  # the first step: buffers, then written to the file
        for step in range(2, 6):
            steps.take(step, _state(step))
            steps.wait()
            assert writes.bytes == first, f"step {step} wrote its state through a file"
            # the snapshot pool lends the slot's memory, not host buffers of its own
            assert not any(steps.pool._free.values())
            _same(_state(step), steps.tier.load(0, step, steps.tier.generation))
        assert _visible(steps) == [steps.tier.name(0, 5)]
    finally:
        steps.close()


def test_a_slot_written_part_is_checked_by_hash(tmp_path: Path) -> None:
    steps = _steps(tmp_path)
    try:
        for step in (1, 2):
            steps.take(step, _state(step))
            steps.wait()
        data = steps.tier.parts / steps.tier.name(0, 2) / DATA
        raw = bytearray(data.read_bytes())
        raw[100] ^= 1
        data.write_bytes(bytes(raw))
        with pytest.raises(MemoryPartError, match="does not match its hash"):
            steps.tier.load(0, 2, steps.tier.generation)
    finally:
        steps.close()


def test_a_reused_file_never_changes_a_visible_part(tmp_path: Path) -> None:
    steps = _steps(tmp_path)
    tier = steps.tier
    try:
        for step in (1, 2, 3):
            steps.take(step, _state(step))
            steps.wait()
        # step 2's file is now the spare: step 4 is copied into it while step 3 stays visible
        snap = tier.snapshot(_state(4), 0)
        assert snap.slot is not None and not snap.buffers()
        assert not snap.slot.path.name.startswith("s")  # out of sight while it changes
        _same(_state(3), tier.load(0, 3, tier.generation))
        assert tier.write(snap, 0, 4)
        _same(_state(4), tier.load(0, 4, tier.generation))
        _same(_state(3), tier.load(0, 3, tier.generation))
    finally:
        steps.close()


def test_a_state_that_grows_is_written_whole_and_the_next_step_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _Writes(monkeypatch)
    steps = _steps(tmp_path)
    try:
        for step, rows in ((1, 8), (2, 8), (3, 64), (4, 64)):
            before = writes.bytes
            steps.take(step, _state(step, rows))
            steps.wait()
            _same(_state(step, rows), steps.tier.load(0, step, steps.tier.generation))
            if step == 3:  # what did not fit in the file went after it, in the background
                assert writes.bytes > before
            if step == 4:  # the file grew with it
                assert writes.bytes == before
    finally:
        steps.close()


def test_no_room_for_a_slot_falls_back_to_buffers_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _steps(tmp_path)
    try:
        steps.take(1, _state(1))
        steps.wait()

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr("lightning_incremental.runtime.memory.slots.os.posix_fallocate", full)
        steps.take(2, _state(2))  # training goes on
        steps.wait()
        _same(_state(2), steps.tier.load(0, 2, steps.tier.generation))
        assert not any(p.name.startswith(".slot-") for p in steps.tier.parts.iterdir())
    finally:
        steps.close()


def test_a_slots_pages_are_allocated_before_anything_is_copied_into_it(tmp_path: Path) -> None:
    steps = _steps(tmp_path)
    try:
        steps.take(1, _state(1))
        steps.wait()
        snap = steps.tier.snapshot(_state(2), 0)
        assert snap.slot is not None
        st = os.stat(snap.slot.path / DATA)
        assert st.st_size == snap.slot.capacity >= snap.used
        assert st.st_blocks * 512 >= snap.slot.capacity  # posix_fallocate: ENOSPC, not SIGBUS
        assert steps.tier.write(snap, 0, 2)
    finally:
        steps.close()


def test_a_process_leaves_only_its_parts_and_a_finished_one_nothing(tmp_path: Path) -> None:
    steps = _steps(tmp_path)
    for step in (1, 2, 3):
        steps.take(step, _state(step))
    steps.wait()
    steps.close()
    assert os.listdir(steps.tier.parts) == [steps.tier.name(0, 3)]  # no spare slot
    again = _steps(tmp_path)
    for step in (4, 5, 6):
        again.take(step, _state(step))
    again.wait()
    again.finish()
    again.close()
    assert not again.tier.parts.exists()  # not even the job's directory
    assert os.listdir(tmp_path) == []


def test_the_slots_of_a_process_that_is_gone_are_swept(tmp_path: Path) -> None:
    dead = dead_pid()
    parts = tmp_path / "job"
    for name in (
        f".slot-r000000-0-{dead}",
        f".tmp-s1-g1-r0-{dead}",
        f".slot-r000000-0-{os.getpid()}",
    ):
        (parts / name).mkdir(parents=True)
        (parts / name / DATA).write_bytes(b"x" * 100)
    memory_tier.MemoryTier(tmp_path, job="job", generation=1, world_size=1)
    assert os.listdir(parts) == [f".slot-r000000-0-{os.getpid()}"]  # a live process's stays


def test_a_replica_is_received_straight_into_a_file_of_the_nodes_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = memory_tier.MemoryTier(tmp_path / "a", job="job", generation=1, world_size=2)
    keeper = memory_tier.MemoryTier(tmp_path / "b", job="job", generation=1, world_size=2)
    writes = _Writes(monkeypatch)
    for step, rows in ((1, 64), (2, 64), (3, 8), (4, 64)):  # a smaller part: a smaller file
        assert sender.write(memory_tier.snapshot(_state(step, rows)), 0, step)
        sent = sender.part(0, step, 1)
        before = writes.bytes
        buffer = keeper.receiver(0, sent.data.numel())  # what the exchange receives into
        assert buffer is not None
        buffer.copy_(sent.data)
        assert keeper.write_part(memory_tier.Part(sent.header, sent.index, buffer))
        keeper.unused_receivers()
        assert writes.bytes == before  # no second copy of the received bytes
        _same(_state(step, rows), keeper.load(0, step, 1))
        keeper.prune([0], {(step, 1)})
    assert sorted(p.name[:6] for p in keeper.parts.iterdir()) == [".slot-", "s00000"]


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_a_parallel_read_or_copy_fills_the_buffers_and_hashes_the_bytes_in_order(
    tmp_path: Path, readers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore's read: chunks read at once by several threads land where they belong, and
    the hash, fed in order on the calling thread, is the hash of the file end to end; a file
    shorter than the buffers is an EOFError, never a buffer left partly unread."""
    import numpy as np

    from lightning_incremental.core.codecs.bytes import chunk_hash
    from lightning_incremental.runtime.memory import read as memory_read

    monkeypatch.setattr(memory_read, "READ_CHUNK", 1 << 16)  # many chunks, unaligned ends
    rng = np.random.default_rng(readers)
    sizes = (0, 7, (1 << 16) + 1, 3, 5 << 16, *[5] * 3000, 1 << 16)  # 3,000 views: 3 preadv
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    buffers = [np.full(n, 0xEE, dtype=np.uint8) for n in sizes]
    with open(path, "rb", buffering=0) as f:
        digest = memory_read.read_hashed(f.fileno(), [b.data for b in buffers], readers)
    assert b"".join(b.tobytes() for b in buffers) == data
    assert digest == chunk_hash(data)
    copies = [np.full(n, 0xEE, dtype=np.uint8) for n in sizes]  # from a received buffer
    source = np.frombuffer(data, dtype=np.uint8)
    assert memory_read.copy_hashed(source, [c.data for c in copies], readers) == digest
    assert b"".join(c.tobytes() for c in copies) == data
    path.write_bytes(data[:-5])
    with open(path, "rb", buffering=0) as f, pytest.raises(EOFError, match="ends at byte"):
        memory_read.read_hashed(f.fileno(), [b.data for b in buffers], readers)
