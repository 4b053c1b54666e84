"""The memory tier on one node: a part round-trips bit-exactly, is complete or absent, is checked
by hash on read, keeps only what retention asks for, and never raises for a full or broken
directory."""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_incremental.runtime.memory import tier as mt
from lightning_incremental.runtime.memory.tier import Held, MemoryPartError, MemoryTier, snapshot


def _state() -> dict:
    w = torch.randn(4, 3)
    return {
        "state_dict": OrderedDict(
            w=torch.nn.Parameter(w.clone()), b=torch.arange(5, dtype=torch.int64)
        ),
        "alias": None,
        "half": torch.randn(7).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "flags": torch.tensor([True, False, True]),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "meta": {"epoch": 2, "lr": 0.1, "name": "x", "t": (1, 2)},
        "nan": float("nan"),
    }


def _tier(path: Path, generation: int = 1, job: str = "job") -> MemoryTier:
    return MemoryTier(path, job=job, generation=generation, world_size=2)


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and type(a) is type(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert torch.equal(
            a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
        )
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b
    else:
        assert a == b and type(a) is type(b)


def test_a_part_round_trips_bit_exactly(tmp_path: Path) -> None:
    tier, state = _tier(tmp_path), _state()
    assert tier.write(snapshot(state), 1, 7)
    assert tier.inventory() == [Held(1, 7, 1, "job", 2)]
    _same(state, tier.load(1, 7, 1))


def test_a_changed_byte_is_found_on_read(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(snapshot(_state()), 0, 3)
    (data,) = tier.parts.glob("*/data.bin")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(MemoryPartError, match="does not match its hash"):
        tier.load(0, 3, 1)
    with pytest.raises(MemoryPartError, match="does not match its hash"):
        tier.restore(tier.part(0, 3, 1))  # a part received from a peer is checked alike
    data.write_bytes(bytes(raw[:-1]))
    with pytest.raises(MemoryPartError, match=r"is not \d+ bytes long"):
        tier.load(0, 3, 1)


def test_a_torn_write_is_not_a_part_and_other_jobs_are_refused(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(snapshot(_state()), 0, 3)
    (tier.parts / "s000000000004-g000001-r000000").mkdir()  # no header: torn
    (tier.parts / ".tmp-s5-123").mkdir()
    assert [h.step for h in tier.inventory()] == [3]
    other = _tier(tmp_path, job="other")  # a part of "job" found where "other" keeps its own
    name = "s000000000003-g000001-r000000"
    shutil.copytree(tier.parts / name, other.parts / name)
    with pytest.raises(MemoryPartError, match="not of this job"):
        other.load(0, 3, 1)


def test_the_layout_is_in_the_header_and_older_parts_read_as_whole(tmp_path: Path) -> None:
    """A part says where the replicated state is (its layout); a part of another layout is
    refused, and a header written before layouts existed reads as layout 0 (every part whole)."""
    tier = _tier(tmp_path)
    tier.layout = 2
    tier.write(snapshot({"w": torch.ones(3)}), 1, 5)
    assert tier.inventory() == [Held(1, 5, 1, "job", 2, 2)]
    whole = _tier(tmp_path)
    with pytest.raises(MemoryPartError, match="part of layout 2, not 0"):
        whole.load(1, 5, 1)
    (header,) = tier.parts.glob("*/header.json")
    head = json.loads(header.read_bytes())
    del head["layout"]
    header.write_text(json.dumps(head))
    assert whole.inventory() == [Held(1, 5, 1, "job", 2, 0)]
    assert torch.equal(whole.load(1, 5, 1)["w"], torch.ones(3))


def test_prune_keeps_only_the_asked_steps_of_its_ranks(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    snap = snapshot({"w": torch.ones(3)})
    for step in (1, 2, 3):
        tier.write(snap, 0, step)
        tier.write(snap, 1, step)
    other = _tier(tmp_path, job="other")  # another job in the same directory
    other.write(snap, 0, 2)
    tier.prune([0], {(3, 1)})
    assert sorted((h.rank, h.step) for h in tier.inventory()) == [(0, 3), (1, 1), (1, 2), (1, 3)]
    assert other.inventory() == [Held(0, 2, 1, "other", 2)]
    shutil.copytree(other.parts / other.name(0, 2), tier.parts / other.name(0, 2))
    tier.prune([0], set())  # a part of another job found here is not this job's to delete
    assert [h.job for h in tier.inventory() if h.rank == 0] == ["other"]


def test_prune_keeps_an_earlier_generations_part_only_when_asked(tmp_path: Path) -> None:
    snap = snapshot({"w": torch.ones(3)})
    before, now = _tier(tmp_path, generation=1), _tier(tmp_path, generation=2)
    for step in (4, 5):
        before.write(snap, 0, step)
    now.write(snap, 0, 5)
    now.write(snap, 0, 6)
    now.prune([0], {(4, 1), (6, 2)})  # the step resumed from, and this run's newest
    assert sorted((h.generation, h.step) for h in now.inventory()) == [(1, 4), (2, 6)]


def test_a_part_written_again_replaces_the_old_one(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(snapshot({"w": torch.zeros(2)}), 0, 1)
    tier.write(snapshot({"w": torch.ones(2)}), 0, 1)
    assert torch.equal(tier.load(0, 1, 1)["w"], torch.ones(2))


def test_a_received_part_is_kept_as_it_came(tmp_path: Path) -> None:
    here, there = _tier(tmp_path / "a"), _tier(tmp_path / "b")
    state = _state()
    here.write(snapshot(state), 1, 9)
    assert there.write_part(here.part(1, 9, 1))
    _same(state, there.load(1, 9, 1))
    with pytest.warns(UserWarning, match="a received part is unusable"):
        assert not there.write_part(mt.Part(b"{}", b"", torch.empty(0, dtype=torch.uint8)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_directory_that_refuses_writes_is_a_warning_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job").chmod(0o500)
    try:
        with pytest.warns(UserWarning, match="could not write rank 0's part of step 2"):
            assert not _tier(tmp_path).write(snapshot({"w": torch.ones(2)}), 0, 2)
    finally:
        (tmp_path / "job").chmod(0o700)


def test_a_full_memory_is_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = open

    def full(path: object, mode: str = "r", *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if str(path).endswith(mt.DATA) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", full)
    tier = _tier(tmp_path)
    with pytest.warns(UserWarning, match="No space left") as warned:
        for step in range(1, 101):
            assert not tier.write(snapshot({"w": torch.ones(2)}), 0, step)
    assert len(warned) == 2  # the first failure and the 100th, not one a step
    assert tier.inventory() == [] and list(tier.parts.iterdir()) == []


def test_the_directory_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mt.ENV, raising=False)
    assert mt.default_dir() == Path("/dev/shm/lightning-incremental")
    monkeypatch.setenv(mt.ENV, "/tmp/x")
    assert mt.default_dir() == Path("/tmp/x")


def test_an_index_that_names_bytes_outside_the_data_is_refused(tmp_path: Path) -> None:
    """Even when its hash matches (a writer's bug, not a flipped bit): nothing is allocated for
    it or read past the data."""
    import json

    from lightning_incremental.core.codecs.bytes import chunk_hash

    tier = _tier(tmp_path)
    tier.write(snapshot({"w": torch.ones(4)}), 0, 1)
    (part,) = tier.parts.iterdir()
    index = json.loads((part / mt.INDEX).read_text())
    index["leaves"][0]["offset"] = 1 << 40
    body = json.dumps(index).encode()
    (part / mt.INDEX).write_bytes(body)
    head = json.loads((part / mt.HEADER).read_text())
    head["files"][mt.INDEX] = {"size": len(body), "hash": chunk_hash(body)}
    (part / mt.HEADER).write_text(json.dumps(head))
    with pytest.raises(MemoryPartError, match="names bytes outside its data"):
        tier.load(0, 1, 1)
    with pytest.raises(MemoryPartError, match="names bytes outside its data"):
        tier.restore(tier.part(0, 1, 1))


def _rewrite_index(part: Path, edit: object) -> None:
    """Edit a part's index and make its header's hash of it right again."""
    from lightning_incremental.core.codecs.bytes import chunk_hash

    index = json.loads((part / mt.INDEX).read_text())
    edit(index)  # type: ignore[operator]
    body = json.dumps(index).encode()
    (part / mt.INDEX).write_bytes(body)
    head = json.loads((part / mt.HEADER).read_text())
    head["files"][mt.INDEX] = {"size": len(body), "hash": chunk_hash(body)}
    (part / mt.HEADER).write_text(json.dumps(head))


@pytest.mark.parametrize(
    "edit",
    [
        lambda index: index["leaves"][0].update(slot=1 << 50),  # a list of 2**50 slots
        lambda index: index["leaves"][0].update(shape=[3] * 200_000, nbytes=0),
        lambda index: index["leaves"][0].update(nbytes="16"),
        lambda index: index.update(leaves={"0": 1}),
        lambda index: index.pop("skeleton"),
    ],
    ids=["huge-slot", "many-dims", "size-not-an-int", "leaves-not-a-list", "no-skeleton"],
)
def test_an_index_that_claims_what_its_files_do_not_hold_is_refused(
    tmp_path: Path, edit: object
) -> None:
    """Its hash matches (written so, not flipped): every entry is checked before anything is
    allocated for it, so no claim makes the reader allocate more than the files hold, and a
    malformed index is a MemoryPartError (the group resumes from the store), not a crash."""
    tier = _tier(tmp_path)
    tier.write(snapshot({"w": torch.ones(4)}), 0, 1)
    (part,) = tier.parts.iterdir()
    _rewrite_index(part, edit)
    with pytest.raises(MemoryPartError):
        tier.load(0, 1, 1)
    with pytest.raises(MemoryPartError):
        tier.restore(tier.part(0, 1, 1))


def test_a_header_without_its_files_or_nested_too_deeply_is_not_a_part(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(snapshot({"w": torch.ones(4)}), 0, 1)
    (part,) = tier.parts.iterdir()
    head = json.loads((part / mt.HEADER).read_text())
    del head["files"][mt.DATA]
    (part / mt.HEADER).write_text(json.dumps(head))
    with pytest.raises(MemoryPartError, match="not a memory part header"):
        tier.load(0, 1, 1)
    (part / mt.HEADER).write_text("[" * 100_000)
    with pytest.raises(MemoryPartError, match="unreadable header"):
        tier.load(0, 1, 1)
    assert tier.inventory() == []
