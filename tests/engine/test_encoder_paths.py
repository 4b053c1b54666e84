"""Small chunks are encoded on the scheduling thread, large ones on the workers: both paths
write the same bytes, and a failure on either ends the save with the error. Packs near the end
of a save are smaller."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.chunks import encode as encoder
from lightning_incremental.core.chunks import packs
from lightning_incremental.core.codecs import planes
from tests.conftest import assert_state_equal, small_store

INLINE_MAX = encoder.INLINE_MAX  # as shipped (tests change the module's)


def _states(count: int) -> list[dict[str, torch.Tensor]]:
    """Training-like states: tensors below and above ``INLINE_MAX``, each moving a little."""
    rng = np.random.default_rng(0)
    sizes = {"bias": 96, "norm": 4000, "weight": 3 * INLINE_MAX // 4 + 1000}
    state = {
        k: torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for k, n in sizes.items()
    }
    out = []
    for _ in range(count):
        state = {k: v + torch.randn(v.shape) * 1e-3 for k, v in state.items()}
        out.append({**state, "half": state["norm"].to(torch.bfloat16)})
    return out


@pytest.mark.parametrize("chunk_size", [16 << 10, 1 << 20])
def test_inline_and_worker_encoding_write_the_same_checkpoints(
    local_url: str, monkeypatch: pytest.MonkeyPatch, chunk_size: int
) -> None:
    states = _states(5)
    manifests = {}
    for inline in (INLINE_MAX, 0):  # 0: every chunk on the workers
        monkeypatch.setattr(encoder, "INLINE_MAX", inline)
        with small_store(f"{local_url}-{inline}", chunk_size=chunk_size) as store:
            for step, state in enumerate(states):
                store.save(state, step).wait()
            for step, state in enumerate(states):
                assert_state_equal(store.load(step), state)
            manifests[inline] = [
                (dict(store.manifest(s).chunks), store.manifest(s).packs)
                for s in range(len(states))
            ]
    assert manifests[INLINE_MAX] == manifests[0]


@pytest.mark.parametrize("inline", [True, False])
def test_an_encoding_error_fails_the_save_and_the_next_one_succeeds(
    local_url: str, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    monkeypatch.setattr(encoder, "INLINE_MAX", 1 << 30 if inline else 0)
    states = _states(3)
    with small_store(local_url, chunk_size=1 << 20) as store:
        store.save(states[0], 0).wait()
        real = planes.encode

        def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise MemoryError("simulated: out of memory while encoding")

        monkeypatch.setattr(planes, "encode", broken)
        with pytest.raises(MemoryError, match="simulated"):
            store.save(states[1], 1).wait()
        monkeypatch.setattr(planes, "encode", real)
        store.save(states[2], 2).wait()
        assert store.steps() == [0, 2]
        assert_state_equal(store.load(2), states[2])


def test_packs_near_the_end_of_a_save_are_smaller(local_url: str) -> None:
    """The writes still running when the last chunk is encoded are what a save then waits
    for: the packs of the last quarter are cut down to ``TAIL_PACK``."""
    mib = 1 << 20
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randint(0, 256, (48 * mib,), generator=g, dtype=torch.uint8)}
    with CheckpointStore(
        local_url, chunk_size=mib, pack_size=4 * mib, xor_delta=False, codec_effort="full"
    ) as store:  # paced (auto), its first pack is one chunk: test_pace.py
        store.save(state, 0).wait()
        doc = store.manifest(0)
        order: list[str] = []
        for digest in doc.tensors[0].chunks:  # packs in the order the chunks were written
            pack = doc.chunks[digest].pack
            if pack not in order:
                order.append(pack)
        sizes = [doc.packs[p] / mib for p in order]
        assert_state_equal(store.load(0), state)
    assert sizes[0] == pytest.approx(4, abs=0.1)  # incompressible 1 MiB chunks, 4 MiB packs
    assert all(a >= b - 0.1 for a, b in itertools.pairwise(sizes))  # never larger later on
    assert sizes[-2] == pytest.approx(packs.TAIL_PACK / mib, abs=0.1)
    assert len(sizes) > 48 // 4
