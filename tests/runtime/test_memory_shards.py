"""The memory tier's sharded parts (:mod:`lightning_incremental.runtime.memory.shards`): each
DTensor becomes its local shard with a note of its layout; a resume checks every live DTensor
against the notes (another layout, a missing shard or a stray note is refused) and fills the
live shards. On a one-rank gloo mesh in this process; the two-rank resume is
``tests/lightning/test_callback_sharded.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_incremental.runtime.memory import shards as memory_shards


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
    weight = saved["state_dict"]["w"].clone() + 100
    momentum = saved["optimizer_states"][0]["state"]["w"]["m"].clone()
    restored["state_dict"] = {"w": weight.clone(), "plain": torch.full((2,), 7.0)}
    live = _state(mesh)
    memory_shards.check(live, restored, notes)
    memory_shards.fill(live, restored)
    assert torch.equal(live["state_dict"]["w"].to_local(), weight)
    assert torch.equal(live["optimizer_states"][0]["state"]["w"]["m"].to_local(), momentum)
    # the live DTensors take their places; the rest stays as restored
    assert restored["state_dict"]["w"] is live["state_dict"]["w"]
    assert (
        restored["optimizer_states"][0]["state"]["w"]["m"]
        is live["optimizer_states"][0]["state"]["w"]["m"]
    )
    assert torch.equal(restored["state_dict"]["plain"], torch.full((2,), 7.0))
    assert torch.equal(restored["optimizer_states"][0]["state"]["w"]["step"], torch.tensor(3.0))


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


def test_fsdp2_state_restored_whole_not_only_its_shards(mesh) -> None:
    """FSDP2 on the one-rank mesh, Adam, a scheduler that lowers the learning rate every step and
    batch norm: the memory step's DTensors go into the live shards, and everything else (Adam's
    ``step``, the learning rate in ``param_groups``, the running statistics) comes from the
    memory step too, not from the fresh model it is restored into."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    options = StateDictOptions(full_state_dict=False)

    def build():
        torch.manual_seed(0)
        nn = torch.nn
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def state(model, optimizer):
        return {
            "state_dict": get_model_state_dict(model, options=options),
            "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=options)],
        }

    model, optimizer, scheduler = build()
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    local, notes = memory_shards.to_local(state(model, optimizer))
    saved = copy.deepcopy(local)  # what the memory tier holds
    fresh, fresh_optimizer, _ = build()
    live = state(fresh, fresh_optimizer)
    memory_shards.check(live, saved, notes)
    memory_shards.fill(live, saved)
    set_model_state_dict(fresh, saved["state_dict"], options=options)
    set_optimizer_state_dict(fresh, fresh_optimizer, saved["optimizer_states"][0], options=options)
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.0125
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
        assert torch.equal(a, b), name  # weights, running statistics, batches tracked
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            got = fresh_optimizer.state[q][key]
            value, got = getattr(value, "_local_tensor", value), getattr(got, "_local_tensor", got)
            assert torch.equal(value, got), key  # exp_avg, exp_avg_sq and step
