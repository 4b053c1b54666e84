"""Held bases: a chunk whose chain has room for one delta only stays coded against its standalone
root (``delta_base.hold``) instead of alternating delta, standalone, delta. Dense training in
fp32 is that case (a random walk with multiplicative noise stands for it here: a root is ~0.85x
its raw bytes, a delta ~0.67-0.71x, the chain bound 2x)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.chunks import delta_base
from lightning_incremental.core.codecs.bytes import chunk_hash
from lightning_incremental.core.format.records import ChunkRecipe
from tests.conftest import assert_state_equal

N = 2048  # float32 elements: two chunks of 4 KiB
OPTIONS = {"chunk_size": 4096, "pack_size": 16384, "fsync": False, "workers": 1}


def _states(saves: int, seed: int = 0, renew_every: int = 3) -> list[dict[str, torch.Tensor]]:
    """A random walk (every element moves by ~3 % of itself each save); the second chunk is
    replaced by fresh noise every ``renew_every`` saves (it moves on while the first is held:
    one buffer then holds chunks of two checkpoints); a bias that never changes."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.randn(N, generator=g)
    bias = torch.randn(16, generator=g)
    out = []
    for save in range(saves):
        noise = torch.randn(N, generator=g)
        walk = walk + 0.03 * walk.abs() * noise
        if save % renew_every == renew_every - 1:
            walk[N // 2 :] = noise[N // 2 :]
        out.append({"walk": walk.clone(), "bias": bias.clone()})
    return out


def _recipes(store: CheckpointStore, step: int) -> list[tuple[str, ChunkRecipe]]:
    manifest = store.manifest(step)
    walk = next(t for t in manifest.tensors if "walk" in t.path)
    return [(digest, manifest.chunks[digest]) for digest in walk.chunks]


def _save_all(root: str, states: list[dict[str, torch.Tensor]]) -> CheckpointStore:
    store = CheckpointStore(root, **OPTIONS)
    for step, state in enumerate(states):
        store.save(state, step).wait()
        _check_base_bytes(store)
    return store


def _check_base_bytes(store: CheckpointStore) -> None:
    """Every chunk of the in-memory base is what its digest says (a held buffer mixes chunks
    of two checkpoints)."""
    parent = store._engine.base.parent
    assert parent is not None
    size = OPTIONS["chunk_size"]
    for raw, digests in parent.base.values():
        for index, digest in enumerate(digests):
            assert chunk_hash(raw[index * size : (index + 1) * size]) == digest


def test_a_dense_chunk_stays_on_its_root_and_every_step_restores(tmp_path) -> None:
    states = _states(12)
    with _save_all(str(tmp_path), states) as store:
        held = moved = 0
        for step in range(1, len(states)):
            before, now = _recipes(store, step - 1), _recipes(store, step)
            chunks = store.manifest(step - 1).chunks
            for (old_digest, old), (_, new) in zip(before, now):
                holds = delta_base.hold(old, chunks.get(old.base or ""), 2.0)
                expected = old.base if holds else old_digest
                assert new.base in (None, expected), f"step {step}: coded against {new.base}"
                assert new.chain <= 2.0 * new.size
                held += holds and new.base == expected
                moved += (not holds) and old.base is not None and new.base is None
        # the walking chunk is held all along; the renewed one moves on, then starts a new root
        assert held >= len(states) - 2
        assert moved >= 2
        # up to the next full base (``full_every`` = 10), against the first root
        assert _recipes(store, 9)[0][1].base == _recipes(store, 0)[0][0]
        for step, state in enumerate(states):
            assert_state_equal(store.load(step), state)
            assert store.verify(step).ok


def test_holding_writes_fewer_bytes_than_alternating(tmp_path, monkeypatch) -> None:
    states = _states(10, renew_every=1000)

    def written(root: str) -> tuple[int, int]:
        with _save_all(root, states) as store:
            chunks = [r for step in range(1, len(states)) for _, r in _recipes(store, step)]
            return sum(r.length for r in chunks), sum(r.base is None for r in chunks)

    held_bytes, held_roots = written(str(tmp_path / "held"))
    monkeypatch.setattr(delta_base, "HOLD_MAX", 0.0)
    plain_bytes, plain_roots = written(str(tmp_path / "alternating"))
    assert held_roots == 0 and plain_roots >= 8  # every other save rewrites the chunk whole
    assert held_bytes < 0.95 * plain_bytes


def test_a_chunk_moves_on_once_its_delta_passes_hold_max(tmp_path, monkeypatch) -> None:
    """Deltas against an old root grow with the distance: past ``HOLD_MAX`` of the root, the
    chunk moves on and its next save is a new root."""
    states = _states(12, renew_every=1000)
    with _save_all(str(tmp_path / "probe"), states) as store:
        first, second = _recipes(store, 1)[0][1], _recipes(store, 4)[0][1]
        root = _recipes(store, 0)[0][1]
    # a threshold between the delta at distance 1 and the one at distance 4
    middle = ((first.length + second.length) / 2) / root.length
    monkeypatch.setattr(delta_base, "HOLD_MAX", middle)
    with _save_all(str(tmp_path / "store"), states) as store:
        kinds = [_recipes(store, step)[0][1].base is None for step in range(len(states))]
        assert kinds[0] and not kinds[1]
        assert any(kinds[2:]), "never moved on to a new root"
        for step, state in enumerate(states):
            assert_state_equal(store.load(step), state)


def test_held_chains_survive_a_restart_gc_and_compact(tmp_path) -> None:
    states = _states(8)
    root = str(tmp_path)
    with _save_all(root, states[:5]):
        pass
    # a new process: bases come from storage, the held chain's root included
    with CheckpointStore(root, keep_last=2, **OPTIONS) as store:
        for step in range(5, 8):
            store.save(states[step], step).wait()
        assert store.steps() == [6, 7]
        for step in (6, 7):
            assert_state_equal(store.load(step), states[step])
            assert store.verify(step).ok
        store.compact()
        store.save(states[7], 8).wait()
        assert_state_equal(store.load(8), states[7])
        assert_state_equal(store.load(7), states[7])


@pytest.mark.parametrize("memory", [0, 4096])
def test_within_xor_base_memory_only(tmp_path, memory: int) -> None:
    """Tensors past ``xor_base_memory`` have no base in memory: nothing is held for them, and
    their chunks are coded against the parent's chunks read from storage."""
    states = _states(6)
    with CheckpointStore(str(tmp_path), xor_base_memory=memory, **OPTIONS) as store:
        for step, state in enumerate(states):
            store.save(state, step).wait()
            parent = store._engine.base.parent
            assert parent is not None and sum(r.size for r, _ in parent.base.values()) <= memory
        for step, state in enumerate(states):
            assert_state_equal(store.load(step), state)


def test_hold_refuses_what_is_not_a_lone_lossless_delta_on_a_root() -> None:
    root = ChunkRecipe("p", "a", 0, 850, 1000, 4, chain=850)
    delta = ChunkRecipe("pd", "a", 850, 680, 1000, 4, base="r", depth=1, chain=1530)
    assert delta_base.hold(delta, root, 2.0)
    assert not delta_base.hold(delta, root, 3.0)  # a second delta fits: chain on it
    assert not delta_base.hold(delta, None, 2.0)
    assert not delta_base.hold(root, None, 2.0)  # a root itself moves on
    on_delta = ChunkRecipe("pd", "a", 0, 680, 1000, 4, base="x", depth=1, chain=1530)
    assert not delta_base.hold(delta, on_delta, 2.0)  # only on a standalone root
    lossy = ChunkRecipe("q8", "a", 0, 850, 1000, 4, chain=850, lossless=False, decoded="h")
    assert not delta_base.hold(delta, lossy, 2.0)
    big = ChunkRecipe("pd", "a", 850, 800, 1000, 4, base="r", depth=1, chain=1650)
    assert not delta_base.hold(big, root, 2.0)  # past HOLD_MAX of the root: move on
    assert np.isclose(delta_base.HOLD_MAX, 0.9)
