"""The byte-plane codecs in the engine, and the opt-in quantized optimizer state end to end:
new saves use ``p``/``pd``; checkpoints written with the earlier ``z``/``x`` codecs keep loading
and a new delta chains onto them; ``optimizer_state`` quantizes exactly the optimizer moments
(torch, Lightning and Accelerate key paths), labels them, verifies them, warns on load, and
detects their corruption; the default stays exact."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core import StoreConfig, codecs
from lightning_incremental.core.chunks.lossy import lossy_codec
from lightning_incremental.core.codecs import registry
from lightning_incremental.core.codecs.optimizer_state import codec_kind, moment
from lightning_incremental.core.errors import ConfigError, CorruptCheckpointError
from tests.conftest import assert_state_equal, small_store


def _adam_state(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        _train(model, opt)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_new_saves_use_the_plane_codecs_and_restore_exactly(local_url: str) -> None:
    model, opt = _adam_state()
    with small_store(local_url) as store:
        store.save(_state(model, opt), 1).wait()
        _train(model, opt)
        state = _state(model, opt)
        store.save(state, 2).wait()
        kinds = {r.kind for r in store.manifest(2).chunks.values()}
        # "s": a new small chunk with no base (the biases' first save) is stored as it is
        assert kinds <= {"p", "pd", "s"} and "pd" in kinds
        assert store.manifest(2).lossless
        assert store.verify(2).ok
        assert_state_equal(store.load(2), state)


def test_old_checkpoints_load_and_a_new_delta_chains_onto_them(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _adam_state()
    states = {}
    with monkeypatch.context() as m:  # the encoder of earlier versions: z and x only
        m.setattr(registry, "automatic", lambda: [codecs.STANDALONE, codecs.XOR])
        with small_store(local_url, max_chain_ratio=10.0) as store:
            for step in (1, 2):
                states[step] = _state(model, opt)
                store.save(states[step], step).wait()
                states[step] = store.load(step)  # a copy: training goes on in place
                _train(model, opt)
            kinds = {r.kind for r in store.manifest(2).chunks.values()}
            assert {"z", "x"} <= kinds <= {"z", "x", "s"}  # s: new small chunks, stored
    with small_store(local_url, max_chain_ratio=10.0) as store:  # a new version opens it
        states[3] = _state(model, opt)
        store.save(states[3], 3).wait()
        doc = store.manifest(3)
        new = {d: r for d, r in doc.chunks.items() if r.kind in ("p", "pd")}
        assert any(r.kind == "pd" and doc.chunks[r.base].kind in ("z", "x") for r in new.values())
        for step in (1, 2, 3):
            assert store.verify(step).ok
            assert_state_equal(store.load(step), states[step])


def test_a_delta_is_never_coded_twice() -> None:
    """With a base, ``p`` is not raced beside ``pd``: ``pd`` decides, ``p`` codes what it
    declines."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(1 << 16).astype(np.float32)
    moved = (base + rng.standard_normal(base.size).astype(np.float32) * 1e-4).view(np.uint8)
    calls: list[str] = []

    class Counting(codecs.PLANES.__class__):
        def encode(self, raw, base, *, width, level):  # type: ignore[no-untyped-def]
            calls.append("p")
            return super().encode(raw, base, width=width, level=level)

    chosen, blob = codecs.encode_best(
        moved, base.view(np.uint8), 4, 1, candidates=[Counting(), codecs.PLANES_DELTA]
    )
    assert chosen.kind == "pd" and calls == []
    noise = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    chosen, blob = codecs.encode_best(
        noise, noise[::-1].copy(), 4, 1, candidates=[Counting(), codecs.PLANES_DELTA]
    )
    assert chosen.kind == "p" and calls == ["p"]
    assert codecs.decode(blob, "p", 4, noise.size).tobytes() == noise.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(max_size=5000),
    width=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
    changed=st.floats(0, 1),
)
def test_default_race_round_trips(data: bytes, width: int, seed: int, changed: float) -> None:
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    rng = np.random.default_rng(seed)
    base = raw.copy()
    mask = rng.random(raw.size) < changed
    base[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    for b in (None, base):
        chosen, blob = codecs.encode_best(raw, b, width, 1)
        assert chosen.lossless and chosen.kind in ("p", "pd")
        assert codecs.decode(blob, chosen.kind, width, raw.size, base=b).tobytes() == data


@pytest.mark.parametrize("kind", ["q8", "l8", "b16"])
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-8, 1e-3, 10]))
def test_lossy_codecs_are_idempotent_through_the_registry(
    kind: str, n: int, seed: int, scale: float
) -> None:
    """Decoding gives float32 values that the codec codes to the same payload again."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * np.float32(scale)
    if kind == "l8":
        x = np.square(x)
    codec = codecs.get(kind)
    assert not codec.lossless and not codec.needs_base
    blob = codec.encode(x.view(np.uint8), None, width=4, level=1)
    assert blob is not None
    once = codecs.decode(blob, kind, 4, x.nbytes)
    again = codec.encode(once, None, width=4, level=1)
    assert again == blob
    assert codecs.decode(again, kind, 4, x.nbytes).tobytes() == once.tobytes()


def test_lossy_codecs_decline_what_they_cannot_code() -> None:
    x = np.arange(1024, dtype=np.float32)
    assert codecs.INT8.encode(x.view(np.uint8), None, width=2, level=1) is None  # not float32
    assert codecs.LOG8.encode((-x).view(np.uint8), None, width=4, level=1) is None  # negative
    x[3] = np.nan
    for codec in (codecs.INT8, codecs.LOG8, codecs.BF16):
        assert codec.encode(x.view(np.uint8), None, width=4, level=1) is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("state['optimizer']['state'][0]['exp_avg']", "first"),  # torch
        ("state['state'][12]['exp_avg_sq']", "second"),  # an optimizer's own state_dict
        ("state['optimizer_states'][0]['state'][3]['exp_avg']", "first"),  # Lightning
        ("state['optimizer_states'][1]['state'][3]['max_exp_avg_sq']", "second"),
        ("state['optimizers'][0]['state'][7]['exp_avg_sq']", "second"),  # Accelerate
        ("state['optim']['state']['layer.0.weight']['exp_avg']", "first"),  # keyed by name
        ("state['optimizer']['state'][0]['step']", None),
        ("state['optimizer']['param_groups'][0]['lr']", None),
        ("state['state_dict']['exp_avg']", None),  # a weight that happens to be so named
        ("state['model']['exp_avg_sq']", None),
        ("state['optimizer']['state'][0]['momentum_buffer']", None),
    ],
)
def test_moments_are_recognised_by_key_path(path: str, expected: str | None) -> None:
    assert moment(path) == expected
    assert codec_kind(path, "exact") is None
    want = {"first": ("b16", "q8"), "second": ("b16", "l8"), None: (None, None)}[expected]
    assert (codec_kind(path, "bf16"), codec_kind(path, "int8")) == want


def test_only_float32_moments_are_coded_lossily() -> None:
    config = StoreConfig(optimizer_state="int8")
    path = "state['optimizer']['state'][0]['exp_avg']"
    assert lossy_codec(path, config, "float32") is codecs.INT8
    for dtype in ("bfloat16", "float16", "float64", "int32", "<f4"):
        assert lossy_codec(path, config, dtype) is None
    assert lossy_codec(path, StoreConfig(), "float32") is None


def test_lossy_codecs_config_names_standalone_codecs_only() -> None:
    assert StoreConfig(lossy_codecs={"state['opt']": "l8"}).lossy_codecs
    with pytest.raises(ConfigError, match="is a delta; name its standalone codec 'l8'"):
        StoreConfig(lossy_codecs={"state['opt']": "l8d"})


def test_default_is_exact_and_bad_policies_are_refused() -> None:
    assert StoreConfig().optimizer_state == "exact"
    for bad in ("int4", "INT8", "", None, True):
        with pytest.raises(ConfigError, match="optimizer_state"):
            StoreConfig(optimizer_state=bad)  # type: ignore[arg-type]


def test_default_store_writes_optimizer_state_exactly(local_url: str) -> None:
    model, opt = _adam_state()
    state = _state(model, opt)
    with small_store(local_url) as store:
        store.save(state, 1).wait()
        assert store.manifest(1).lossless and not store.verify(1).lossy
        assert_state_equal(store.load(1), state)


@pytest.mark.parametrize("policy", ["bf16", "int8"])
def test_quantized_optimizer_state_end_to_end(
    local_url: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _adam_state()
    state = _state(model, opt)
    caplog.set_level(logging.WARNING, "lightning_incremental")
    with small_store(local_url, optimizer_state=policy) as store:
        assert "not bit-exact" in caplog.text  # the store says so when opened
        store.save(state, 1).wait()
        doc = store.manifest(1)
        moments = sorted(
            t.path for t in doc.tensors if t.path.endswith(("['exp_avg']", "['exp_avg_sq']"))
        )
        assert sorted(doc.lossy_tensors) == moments and moments
        kinds = {doc.chunks[d].kind for t in doc.tensors if t.path in moments for d in t.chunks}
        assert kinds == ({"b16"} if policy == "bf16" else {"q8", "l8"})
        report = store.verify(1)
        assert report.ok and sorted(report.lossy) == moments

        caplog.clear()
        back = store.load(1)
        assert "not bit-exact" in caplog.text and moments[0] in caplog.text
        assert_state_equal(back["model"], state["model"])  # weights stay exact
        for pid, entry in state["optimizer"]["state"].items():
            got = back["optimizer"]["state"][pid]
            assert torch.equal(got["step"], entry["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                want = entry[name]
                tol = 0.004 if policy == "bf16" else (0.03 if name == "exp_avg_sq" else 0.01)
                err = (got[name] - want).abs() / want.abs().max().clamp_min(1e-30)
                assert got[name].dtype == want.dtype and float(err.max()) <= tol
                if name == "exp_avg_sq":
                    assert bool((got[name] >= 0).all())

        # A corrupted quantized chunk is detected, never returned.
        entry_path = moments[0]
        tensor = next(t for t in doc.tensors if t.path == entry_path)
        recipe = doc.chunks[tensor.chunks[0]]
        path = f"{local_url}/{recipe.pack}"
        data = bytearray(open(path, "rb").read())
        data[recipe.offset + recipe.length - 1] ^= 0x21
        open(path, "wb").write(bytes(data))
        assert not store.verify(1).ok
        with pytest.raises(CorruptCheckpointError):
            store.load(1)


def test_a_lossy_checkpoint_reads_back_without_the_setting(local_url: str) -> None:
    """The manifest says how each chunk was coded: an exact store reads an int8 checkpoint, and
    its next save codes the moments losslessly again."""
    model, opt = _adam_state()
    with small_store(local_url, optimizer_state="int8") as store:
        store.save(_state(model, opt), 1).wait()
    with small_store(local_url) as store:
        back = store.load(1)
        opt.load_state_dict(back["optimizer"])
        _train(model, opt)
        state = _state(model, opt)
        store.save(state, 2).wait()
        assert store.manifest(2).lossless
        assert_state_equal(store.load(2), state)


def _as_coded(t: torch.Tensor, codec: codecs.Codec, chunk: int = 4096) -> torch.Tensor:
    """``t`` as ``codec`` decodes it chunk by chunk (the values a lossy checkpoint restores)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    out = np.empty_like(raw)
    for at in range(0, raw.size, chunk):
        blob = codec.encode(raw[at : at + chunk], None, width=4, level=1)
        assert blob is not None
        codecs.decode(blob, codec.kind, 4, raw[at : at + chunk].size, out=out[at : at + chunk])
    return torch.from_numpy(out.view(np.float32).copy()).reshape(t.shape)


@pytest.mark.parametrize("policy", ["int8", "bf16"])
def test_second_moments_chain_as_lossy_deltas(local_url: str, policy: str) -> None:
    """``exp_avg_sq`` barely moves between checkpoints: its codes are stored as deltas against
    the previous checkpoint's decoded chunk — in memory, and after a restart from storage — and
    every step restores exactly the values its standalone code would."""
    model, opt = _adam_state(steps=40)
    second = codecs.LOG8 if policy == "int8" else codecs.BF16
    expected = {}
    for session in range(2):  # the second session reads its bases from storage
        with small_store(local_url, optimizer_state=policy, max_chain_ratio=10.0) as store:
            for step in range(3 * session + 1, 3 * session + 4):
                opt.param_groups[0]["lr"] = 1e-5  # slow moments, as late in training
                _train(model, opt)
                state = _state(model, opt)
                store.save(state, step).wait()
                expected[step] = {
                    pid: _as_coded(entry["exp_avg_sq"], second)
                    for pid, entry in state["optimizer"]["state"].items()
                }
            doc = store.manifest(3 * session + 3)
            kinds = {r.kind for r in doc.chunks.values()}
            assert codecs.delta_of(second).kind in kinds  # type: ignore[union-attr]
            deltas = [r for r in doc.chunks.values() if not r.lossless and r.base is not None]
            assert all(not doc.chunks[r.base].lossless for r in deltas)
    with small_store(local_url) as store:
        for step, moments in expected.items():
            assert store.verify(step).ok
            back = store.load(step)["optimizer"]["state"]
            for pid, want in moments.items():
                assert torch.equal(back[pid]["exp_avg_sq"], want)


def test_the_validator_keeps_lossless_and_lossy_chains_apart() -> None:
    from lightning_incremental.core.errors import ManifestError
    from lightning_incremental.core.format.records import ChunkRecipe
    from lightning_incremental.core.format.validation import _check_base

    def recipe(kind: str, base: str | None = None, depth: int = 0) -> ChunkRecipe:
        lossless = codecs.get(kind).lossless
        return ChunkRecipe(
            kind=kind,
            pack="p",
            offset=0,
            length=1,
            size=8,
            width=4,
            base=base,
            depth=depth,
            chain=1,
            lossless=lossless,
            decoded=None if lossless else "0" * 32,
        )

    chunks = {"a": recipe("l8"), "b": recipe("p"), "c": recipe("q8")}
    _check_base("d", recipe("l8d", "a", 1), chunks, "test")  # a lossy delta on its own code
    _check_base("d", recipe("pd", "b", 1), chunks, "test")
    for bad in (recipe("pd", "a", 1), recipe("l8d", "b", 1), recipe("l8d", "c", 1)):
        with pytest.raises(ManifestError, match="inconsistent base"):
            _check_base("d", bad, chunks, "test")


def test_a_delta_past_the_chain_bound_is_coded_on_its_sample_only() -> None:
    rng = np.random.default_rng(2)
    base = rng.standard_normal(1 << 16).astype(np.float32)
    moved = (base + rng.standard_normal(base.size).astype(np.float32) * 1e-4).view(np.uint8)
    sizes: list[int] = []

    class Counting(codecs.PLANES_DELTA.__class__):
        def encode(self, raw, base, *, width, level):  # type: ignore[no-untyped-def]
            sizes.append(raw.size)
            return super().encode(raw, base, width=width, level=level)

    delta = Counting()
    chosen, _ = codecs.encode_best(
        moved, base.view(np.uint8), 4, 1, delta_budget=1000, candidates=[codecs.PLANES, delta]
    )
    assert chosen.kind == "p" and sizes and max(sizes) < moved.size
    sizes.clear()
    chosen, blob = codecs.encode_best(
        moved, base.view(np.uint8), 4, 1, delta_budget=moved.size, candidates=[codecs.PLANES, delta]
    )
    assert chosen is delta and max(sizes) == moved.size and len(blob) < moved.size
