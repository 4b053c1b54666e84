"""The memory tier's sharded parts (:mod:`lightning_incremental.runtime.memory_shards`): each
DTensor becomes its local shard with a note of its layout; a resume checks every live DTensor
against the notes (another layout, a missing shard or a stray note is refused) and fills the
live shards. On a one-rank gloo mesh in this process; the two-rank resume is
``tests/lightning/test_callback_sharded.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_incremental.runtime import memory_shards


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


def _state(mesh, placement=None, rows: int = 4):
    from torch.distributed.tensor import DTensor, Shard

    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    dt = DTensor.from_local(weight, mesh, [placement or Shard(0)], run_check=False)
    return {
        "state_dict": {"w": dt, "plain": torch.ones(2)},
        "optimizer_states": [{"state": {"w": {"step": torch.tensor(3.0), "m": dt * 2}}}],
        "epoch": 1,
    }


def test_to_local_keeps_shards_as_plain_tensors_and_notes_their_layout(mesh) -> None:
    from torch.distributed.tensor import DTensor

    state = _state(mesh)
    local, notes = memory_shards.to_local(state)
    assert not any(isinstance(v, DTensor) for v in local["state_dict"].values())
    assert local["state_dict"]["plain"] is state["state_dict"]["plain"]
    assert torch.equal(local["state_dict"]["w"], state["state_dict"]["w"].to_local())
    assert sorted(notes) == [
        "'optimizer_states'/0/'state'/'w'/'m'",
        "'state_dict'/'w'",
    ]
    assert notes["'state_dict'/'w'"] == [[4, 3], [4, 3], "torch.float32", ["S(0)"], [1], [0]]
    untouched = {"a": [torch.zeros(1)], "b": 2}
    assert memory_shards.to_local(untouched)[0] is untouched  # nothing rebuilt without DTensors


def test_a_matching_layout_is_filled_into_the_live_shards(mesh) -> None:
    saved, notes = memory_shards.to_local(_state(mesh))
    restored = {k: v for k, v in saved.items()}
    restored["state_dict"] = {"w": saved["state_dict"]["w"].clone() + 100, "plain": torch.ones(2)}
    live = _state(mesh)
    memory_shards.check(live, restored, notes)
    memory_shards.fill(live, restored)
    assert torch.equal(live["state_dict"]["w"].to_local(), restored["state_dict"]["w"])
    got = live["optimizer_states"][0]["state"]["w"]["m"].to_local()
    assert torch.equal(got, saved["optimizer_states"][0]["state"]["w"]["m"])


def test_another_layout_or_shape_or_a_missing_shard_is_refused(mesh) -> None:
    from torch.distributed.tensor import Replicate

    saved, notes = memory_shards.to_local(_state(mesh))
    with pytest.raises(ValueError, match=r"'state_dict'/'w': sharded as .*'S\(0\)'.* now"):
        memory_shards.check(_state(mesh, Replicate()), saved, notes)
    with pytest.raises(ValueError, match=r"sharded as \[\[4, 3\].* as \[\[5, 3\]"):
        memory_shards.check(_state(mesh, rows=5), saved, notes)
    torn = {**saved, "state_dict": {"plain": torch.ones(2)}}
    with pytest.raises(ValueError, match="holds no shard of shape"):
        memory_shards.check(_state(mesh), torn, notes)
    stray = {**notes, "'state_dict'/'gone'": notes["'state_dict'/'w'"]}
    with pytest.raises(ValueError, match="holds 3 shards, the live state 2"):
        memory_shards.check(_state(mesh), saved, stray)
    with pytest.raises(ValueError, match="no notes"):
        memory_shards.check(_state(mesh), saved, None)
