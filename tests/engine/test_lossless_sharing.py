"""A lossless tensor never restores another tensor's lossy bytes.

A lossy chunk is keyed apart from a lossless chunk of the same raw bytes (its key is derived from
its raw hash and its codec), so content shared between a tensor opted in to a lossy codec and one
that is not is stored twice — once lossily, once exactly — in the same save, across saves, in
either order, and under ``optimizer_state="int8"`` (a moment equal to a weight, zero moments equal
to a zero buffer). Lossy tensors sharing content still share chunks, and an unchanged lossy chunk
is still referenced by the next save, not coded again.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.chunks import encode as encoder_module
from lightning_incremental.core.codecs import HASH_LEN, chunk_hash
from tests.conftest import small_store

KINDS = ["q8", "l8", "b16"]
N = 4096  # float32 elements: four 4 KiB chunks


def _values(seed: int, n: int = N) -> torch.Tensor:
    """Positive values: every lossy codec here codes them (``l8`` declines negative ones)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).abs() * 1e-2 + 1e-4


def _entries(store: CheckpointStore, step: int) -> dict[str, tuple[str, ...]]:
    return {t.path: t.chunks for t in store.manifest(step).tensors}


def test_the_lossy_key_is_a_hash_apart_from_the_raw_one() -> None:
    from lightning_incremental.core.chunks.lossy import lossy_key

    digest = chunk_hash(b"some chunk")
    keys = {kind: lossy_key(digest, kind) for kind in KINDS}
    assert len(set(keys.values())) == len(KINDS) and digest not in keys.values()
    assert all(len(k) == HASH_LEN and int(k, 16) >= 0 for k in keys.values())
    assert lossy_key(digest, "q8") == keys["q8"]  # a pure function: the same next save


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lossy_first", [True, False])
def test_same_save_shared_content_stays_exact(local_url: str, kind: str, lossy_first: bool) -> None:
    w = _values(0)
    pairs = [("ema", w), ("model", w.clone())]
    state = dict(pairs if lossy_first else pairs[::-1])
    with small_store(local_url, lossy_codecs={"state['ema']": kind}) as store:
        store.save(state, 1).wait()
        doc = store.manifest(1)
        assert doc.lossy_tensors == ["state['ema']"]
        back = store.load(1)
        assert torch.equal(back["model"], w)
        assert not torch.equal(back["ema"], w)  # coded lossily, as asked
        entries = _entries(store, 1)
        assert not set(entries["state['model']"]) & set(entries["state['ema']"])
        assert all(doc.chunks[d].lossless for d in entries["state['model']"])
        assert store.verify(1).ok


@pytest.mark.parametrize("kind", KINDS)
def test_lossy_tensors_sharing_content_still_share_chunks(local_url: str, kind: str) -> None:
    w = _values(1)
    state = {"lossy": {"a": w, "b": w.clone()}, "model": w.clone()}
    with small_store(local_url, lossy_codecs={"state['lossy']": kind}) as store:
        result = store.save(state, 1).wait()
        entries = _entries(store, 1)
        assert entries["state['lossy']['a']"] == entries["state['lossy']['b']"]
        assert sorted(store.manifest(1).lossy_tensors) == [
            "state['lossy']['a']",
            "state['lossy']['b']",
        ]
        assert result.chunks_reused == N * 4 // 4096  # b's chunks: a's
        back = store.load(1)
        assert torch.equal(back["model"], w)
        assert torch.equal(back["lossy"]["a"], back["lossy"]["b"])


@pytest.mark.parametrize("kind", KINDS)
def test_across_saves_in_both_directions(local_url: str, kind: str) -> None:
    """Step 2 keeps step 1's tensors and adds a lossless one holding step 1's lossy bytes and a
    lossy one holding step 1's lossless bytes; step 3 changes nothing and reuses every chunk."""
    w, v = _values(2), _values(3)
    lossy = ["state['ema']", "state['ema_of_model']"]
    with small_store(local_url, lossy_codecs={"state['ema": kind}) as store:
        store.save({"ema": w, "model": v}, 1).wait()
        first = _entries(store, 1)
        state = {"ema": w, "model": v, "plain": w.clone(), "ema_of_model": v.clone()}
        second = store.save(state, 2).wait()
        entries = _entries(store, 2)
        assert entries["state['ema']"] == first["state['ema']"]  # unchanged: referenced
        assert entries["state['model']"] == first["state['model']"]
        assert second.chunks_reused == 8 and second.chunks_full == 8
        back = store.load(2)
        assert torch.equal(back["model"], v) and torch.equal(back["plain"], w)
        assert torch.equal(back["ema"], store.load(1)["ema"])  # the same lossy chunks
        assert not torch.equal(back["ema_of_model"], v)
        assert sorted(store.manifest(2).lossy_tensors) == lossy
        assert torch.equal(store.load(1)["model"], v)

        again = store.save(state, 3).wait()
        assert again.chunks_reused == again.chunks_total  # lossy and lossless chunks alike
        assert _entries(store, 3) == entries
        assert store.verify(3).ok


@pytest.mark.parametrize("kind", KINDS)
def test_a_tensor_added_later_with_shared_content(local_url: str, kind: str) -> None:
    w = _values(4)
    with small_store(local_url, lossy_codecs={"state['ema']": kind}) as store:
        store.save({"ema": w}, 1).wait()
        store.save({"ema": w, "model": w.clone()}, 2).wait()
        assert torch.equal(store.load(2)["model"], w)
        assert store.manifest(2).lossy_tensors == ["state['ema']"]
    with small_store(local_url + "2", lossy_codecs={"state['ema']": kind}) as store:
        store.save({"model": w}, 1).wait()
        store.save({"model": w, "ema": w.clone()}, 2).wait()
        back = store.load(2)
        assert torch.equal(back["model"], w)
        assert not torch.equal(back["ema"], w)
        assert store.manifest(2).lossy_tensors == ["state['ema']"]


def _adam_like(weight: torch.Tensor, optimizer_first: bool) -> dict:
    """A state whose first moment equals a weight and whose second moment is zero, like a
    registered zero buffer."""
    model = {"weight": weight, "running": torch.zeros(N)}
    optimizer = {
        "state": {
            0: {
                "step": torch.tensor(1.0),
                "exp_avg": weight.clone(),
                "exp_avg_sq": torch.zeros(N),
            }
        },
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    pairs = [("optimizer", optimizer), ("model", model)]
    return dict(pairs if optimizer_first else pairs[::-1])


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_int8_moments_equal_to_weights_and_zero_buffers(
    local_url: str, optimizer_first: bool
) -> None:
    w = _values(5)
    moment = "state['optimizer']['state'][0]"
    moments = [f"{moment}['exp_avg']", f"{moment}['exp_avg_sq']"]
    with small_store(local_url, optimizer_state="int8") as store:
        store.save(_adam_like(w, optimizer_first), 1).wait()
        back = store.load(1)
        assert torch.equal(back["model"]["weight"], w)
        assert torch.equal(back["model"]["running"], torch.zeros(N))
        assert sorted(store.manifest(1).lossy_tensors) == moments
        # Step 2: the weight moves onto what the moment held, the buffer stays zero.
        state = _adam_like(_values(6), optimizer_first)
        state["model"]["weight"] = w.clone()
        store.save(state, 2).wait()
        back = store.load(2)
        assert torch.equal(back["model"]["weight"], w)
        assert torch.equal(back["model"]["running"], torch.zeros(N))
        assert sorted(store.manifest(2).lossy_tensors) == moments


@pytest.mark.parametrize("ema_first", [True, False])
def test_an_old_manifest_keyed_by_raw_hash_loads_and_is_built_on(
    local_url: str, monkeypatch: pytest.MonkeyPatch, ema_first: bool
) -> None:
    """Checkpoints written before lossy chunks had keys of their own (keyed by their raw hash)
    still load, and a save on top of one keeps its lossless tensors exact even when they share
    a raw hash with the old lossy chunks."""
    w = _values(7)
    if not ema_first:
        local_url += "-model-first"
    with monkeypatch.context() as patch:
        patch.setattr(encoder_module, "lossy_key", lambda digest, kind: digest)
        with small_store(local_url, lossy_codecs={"state['ema']": "l8"}) as store:
            store.save({"ema": w}, 1).wait()
            entry = _entries(store, 1)["state['ema']"]
            assert entry[0] == chunk_hash(w.view(torch.uint8).numpy()[:4096].tobytes())
    with small_store(local_url, lossy_codecs={"state['ema']": "l8"}) as store:
        assert not torch.equal(store.load(1)["ema"], w)
        moved = w.clone()
        moved[::7] += 1e-6  # a lossy delta against the old chunks
        pairs = [("ema", moved), ("model", w.clone())]
        store.save(dict(pairs if ema_first else pairs[::-1]), 2).wait()
        # Built on the old chunks, the keys would clash: no delta on them.
        assert all(r.base is None for r in store.manifest(2).chunks.values())
        back = store.load(2)
        assert torch.equal(back["model"], w)
        assert store.manifest(2).lossy_tensors == ["state['ema']"]
        assert store.verify(2).ok


def test_a_chunk_its_lossy_codec_declines_is_stored_exactly_and_shared(local_url: str) -> None:
    """``l8`` cannot code negative values: such a chunk is stored exactly, under its raw hash,
    and may then be shared with a lossless tensor of the same bytes."""
    w = -_values(8)
    w[N // 2 :] *= -1  # the second half is codable
    with small_store(local_url, lossy_codecs={"state['ema": "l8"}) as store:
        store.save({"ema": w, "ema2": w.clone(), "model": w.clone()}, 1).wait()
        doc = store.manifest(1)
        entries = _entries(store, 1)
        ema, model = entries["state['ema']"], entries["state['model']"]
        assert entries["state['ema2']"] == ema
        assert ema[:2] == model[:2] and not set(ema[2:]) & set(model[2:])
        back = store.load(1)
        assert torch.equal(back["model"], w)
        assert torch.equal(back["ema"][: N // 2], w[: N // 2])
        assert torch.equal(back["ema"], back["ema2"]) and not torch.equal(back["ema"], w)
        assert doc.lossy_tensors == ["state['ema']", "state['ema2']"]
        assert store.verify(1).ok

        again = store.save({"ema": w, "ema2": w.clone(), "model": w.clone()}, 2).wait()
        assert _entries(store, 2) == entries
        assert torch.equal(store.load(2)["model"], w)
        # ema's two declined chunks are offered to l8 again (and declined); ema2 reuses them.
        assert again.chunks_reused == again.chunks_total - 2


@contextlib.contextmanager
def _store(**options: object) -> Iterator[CheckpointStore]:
    with tempfile.TemporaryDirectory() as root, small_store(f"{root}/s", **options) as store:
        yield store


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    contents=st.lists(st.integers(0, 2), min_size=2, max_size=5),
    lossy=st.lists(st.booleans(), min_size=5, max_size=5),
    steps=st.lists(st.permutations(range(5)), min_size=1, max_size=2),
)
def test_any_sharing_keeps_lossless_tensors_exact(
    contents: list[int], lossy: list[bool], steps: list[list[int]]
) -> None:
    """Keys ``t0..tk`` each hold one of three contents (the third one ``l8`` cannot code), some
    opted in to ``l8``; each step permutes the key order (and so which tensor is met first) and
    shifts the contents. Lossless keys restore exactly, and the manifest labels exactly the lossy
    keys whose content could be coded lossily."""
    pool = [_values(10, 2048), _values(11, 2048), -_values(12, 2048)]
    names = [f"t{i}" for i in range(len(contents))]
    codecs_for = {f"state['{n}']": "l8" for n, lossy_ in zip(names, lossy) if lossy_}
    with _store(lossy_codecs=codecs_for or None) as store:
        for step, order in enumerate(steps, start=1):
            keys = [names[i] for i in order if i < len(names)]
            which = {n: (contents[names.index(n)] + step) % 3 for n in keys}
            state = {n: pool[which[n]].clone() for n in keys}
            store.save(state, step).wait()
            back = store.load(step)
            for n in keys:
                if f"state['{n}']" not in codecs_for:
                    assert torch.equal(back[n], state[n]), n
            assert sorted(store.manifest(step).lossy_tensors) == sorted(
                f"state['{n}']" for n in keys if f"state['{n}']" in codecs_for and which[n] != 2
            )
