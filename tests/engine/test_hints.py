"""Hints: a changed chunk is coded the way the same place was coded at the previous save (its
predictor, or standalone), without racing the predictors again; every place races again after
``HINT_TTL`` reuses. A hint decides how a chunk is coded, never whether it decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core import codecs
from lightning_incremental.core.chunks import hints as hints_module
from lightning_incremental.core.chunks.hints import HINT_TTL, Hints
from lightning_incremental.core.codecs import Hint
from lightning_incremental.core.codecs import planes as P
from lightning_incremental.core.codecs import predict as pr
from tests.conftest import assert_state_equal, small_store


def _moved(seed: int, n: int = 1 << 14, dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(dtype)
    moved = (base * 0.999 + rng.standard_normal(n).astype(dtype) * 1e-4).astype(dtype)
    return moved.view(np.uint8), base.view(np.uint8)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=3000),
    width=st.sampled_from([1, 2, 3, 4, 8]),
    seed=st.integers(0, 2**16),
    choice=st.sampled_from([pr.NONE, pr.XOR, pr.SUB, pr.SCALED, 7, -1]),
)
def test_a_hinted_chunk_round_trips_whatever_the_hint(
    data: bytes, width: int, seed: int, choice: int
) -> None:
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    rng = np.random.default_rng(seed)
    base = raw.copy()
    mask = rng.random(raw.size) < 0.3
    base[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    codec, blob, made = codecs.encode_choice(raw, base, width, 1, hint=Hint("pd", choice))
    assert codecs.decode(blob, codec.kind, width, raw.size, base=base).tobytes() == data
    assert made is not None and made.kind == "pd"
    applies = choice in pr.NAMES and (choice != pr.SCALED or width in (2, 4))
    if applies:  # coded as told: a delta with that predictor, or standalone for "none"
        assert made.choice == choice
        assert codec.kind == ("p" if choice == pr.NONE else "pd")
        if codec.kind == "pd":
            assert P.header(blob)["predictor"] == choice


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_choice_reported_is_the_one_coded(dtype: type) -> None:
    raw, base = _moved(1, dtype=dtype)
    width = np.dtype(dtype).itemsize
    codec, blob, made = codecs.encode_choice(raw, base, width, 1)
    assert codec.kind == "pd" and made == Hint("pd", P.header(blob)["predictor"])
    assert made.choice != pr.NONE
    # Declined (a base unrelated to the chunk): remembered as "none", coded standalone.
    noise = np.random.default_rng(2).integers(0, 256, raw.size, dtype=np.uint8)
    codec, _, made = codecs.encode_choice(noise, base, width, 1)
    assert codec.kind == "p" and made == Hint("pd", pr.NONE)
    # No base: nothing to remember. A hint for another codec is not applied.
    assert codecs.encode_choice(raw, None, width, 1)[2] is None
    codec, blob, made = codecs.encode_choice(raw, base, width, 1, hint=Hint("other", pr.XOR))
    assert (
        made is not None
        and made.choice
        == P.choose_predictor(raw.view(P._UINT[width]), base.view(P._UINT[width]))[0]
    )


def test_a_hint_skips_the_race(monkeypatch: pytest.MonkeyPatch) -> None:
    raw, base = _moved(3)
    races: list[int] = []
    real = P.choose_predictor
    monkeypatch.setattr(P, "choose_predictor", lambda *a, **k: races.append(1) or real(*a, **k))
    _, _, made = codecs.encode_choice(raw, base, 4, 1)
    assert len(races) == 1 and made is not None
    races.clear()
    _, blob, again = codecs.encode_choice(raw, base, 4, 1, hint=made)
    assert races == [] and again == made
    assert codecs.decode(blob, "pd", 4, raw.size, base=base).tobytes() == raw.tobytes()


def test_hints_are_reused_then_raced_again_spread_over_saves() -> None:
    hints = Hints()
    places = [("w", i) for i in range(64)]
    keys = {"w"}
    assert all(hints.get(p) is None for p in places)  # a new store races everywhere
    sub = Hint("pd", pr.SUB)
    hints.update({p: (sub, False) for p in places}, keys)
    races_per_save = []
    for _ in range(3 * HINT_TTL):
        made, races = {}, 0
        for p in places:
            hint = hints.get(p)
            races += hint is None
            made[p] = (sub, hint is not None)
        races_per_save.append(races)
        hints.update(made, keys)
    # Every place races once per HINT_TTL + 1 saves in steady state, not all in the same save.
    assert sum(races_per_save[HINT_TTL:]) == pytest.approx(
        len(places) * 2 * HINT_TTL / (HINT_TTL + 1), rel=0.15
    )
    assert max(races_per_save) < len(places) // 2
    # Places of a tensor no longer in the state are forgotten; the others are kept.
    hints.update({}, {"other"})
    assert all(hints.get(p) is None for p in places)


def test_a_store_races_each_place_once_then_codes_it_as_before(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves of a training run: the first delta save races every changed chunk, the next ones
    reuse its choices (until a place's hint expires); every checkpoint restores exactly, and
    the bytes stay within 1 % of racing every chunk at every save."""
    races: list[int] = []
    real = P.choose_predictor
    monkeypatch.setattr(P, "choose_predictor", lambda *a, **k: races.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> dict:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(32, 128)).square().mean().backward()
            opt.step()
        return {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {
                k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in s.items()}
                for k, s in opt.state_dict()["state"].items()
            },
        }

    states = [train() for _ in range(HINT_TTL + 4)]
    written = {}
    for ttl in (HINT_TTL, 0):  # 0: never reuse a choice, race every changed chunk
        monkeypatch.setattr(hints_module, "HINT_TTL", ttl)
        races_per_save = []
        written[ttl] = 0
        with small_store(f"{local_url}-{ttl}", chunk_size=16384, full_every=100) as store:
            for step, state in enumerate(states):
                races.clear()
                result = store.save(state, step).wait()
                races_per_save.append((len(races), result.chunks_delta + result.chunks_full))
                written[ttl] += result.bytes_written
            for step, state in enumerate(states):
                assert_state_equal(store.load(step), state)
            assert store.verify(len(states) - 1).ok
        if ttl:
            first_delta, second_delta = races_per_save[1], races_per_save[2]
            assert first_delta[0] == first_delta[1] > 0  # every coded chunk raced
            assert second_delta[0] == 0 and second_delta[1] > 0  # none: all reused
            assert sum(r for r, _ in races_per_save[2:]) < sum(n for _, n in races_per_save[2:])
        else:
            assert all(r == n for r, n in races_per_save[1:])
    assert written[HINT_TTL] == pytest.approx(written[0], rel=0.01)
