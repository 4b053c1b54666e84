"""``memory_model_checkpoints.without``: a ModelCheckpoint state with checkpoints taken out
names none of them among its top-k, best and kth, keeps the rest, and its best and kth are
what ModelCheckpoint computes from the top-k that is left; its last path stays."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_incremental.lightning.memory_model_checkpoints import named, without

scores = st.dictionaries(
    st.sampled_from([f"/c/step={i}.ckpt" for i in range(8)]),
    st.integers(-5, 5).map(lambda v: torch.tensor(float(v))),
    max_size=6,
)


def _state(best_k: dict[str, torch.Tensor], mode: str, last: str) -> dict:
    """As ModelCheckpoint._update_best_and_save leaves it (the kth of a full top-k)."""
    better, worse = (min, max) if mode == "min" else (max, min)
    best = better(best_k, key=best_k.__getitem__) if best_k else ""
    kth = worse(best_k, key=best_k.__getitem__) if best_k else ""
    return {
        "monitor": "loss",
        "best_model_score": best_k[best] if best else None,
        "best_model_path": best,
        "current_score": None,
        "dirpath": "/c",
        "best_k_models": dict(best_k),
        "kth_best_model_path": kth,
        "kth_value": best_k[kth] if kth else torch.tensor(math.inf),
        "last_model_path": last,
    }


@given(
    scores,
    st.sets(st.sampled_from([f"/c/step={i}.ckpt" for i in range(8)] + ["/c/last.ckpt"])),
    st.sampled_from(["min", "max"]),
)
def test_without_names_none_of_the_gone_and_recomputes_best_and_kth(best_k, gone, mode) -> None:
    state = _state(best_k, mode, "/c/last.ckpt")
    out = without(state, gone, mode)
    assert not (named(out) & gone)
    assert named(out) | (named(state) & gone) == named(state)
    kept = {p: s for p, s in best_k.items() if p not in gone}
    assert out["best_k_models"] == kept
    expected = _state(kept, mode, "/c/last.ckpt")
    if state["best_model_path"] in gone:
        assert out["best_model_path"] == expected["best_model_path"]
        assert out["best_model_score"] is expected["best_model_score"] or torch.equal(
            out["best_model_score"], expected["best_model_score"]
        )
    else:
        assert out["best_model_path"] == state["best_model_path"]
    if state["kth_best_model_path"] in gone:
        assert out["kth_best_model_path"] == expected["kth_best_model_path"]
        want = (
            expected["kth_value"]
            if kept
            else torch.tensor(math.inf if mode == "min" else -math.inf)
        )
        assert torch.equal(out["kth_value"], want)
    assert out["last_model_path"] == "/c/last.ckpt"  # Lightning writes the next one over it
    assert state == _state(best_k, mode, "/c/last.ckpt")  # the input is left as it was


def test_a_state_of_another_shape_names_nothing() -> None:
    assert named(None) == set() and named({"best_k_models": None}) == set()


def test_a_check_that_fails_takes_nothing_out(monkeypatch, caplog, tmp_path) -> None:
    """Rank 0's check never raises (the other ranks wait for it in a broadcast): a storage
    backend's own error keeps every path, with a warning in the log."""
    from types import SimpleNamespace

    from lightning_incremental.lightning import memory_model_checkpoints as mmc

    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=object()))
    (tmp_path / "here.ckpt").write_bytes(b"x")
    paths = {str(tmp_path / "here.ckpt"), str(tmp_path / "gone.ckpt")}
    assert mmc._unloadable(trainer, paths) == [str(tmp_path / "gone.ckpt")]

    def broken(path: str) -> bool:
        raise ImportError("no module named 'gcsfs'")

    monkeypatch.setattr(mmc, "_exists", broken)
    assert mmc._unloadable(trainer, paths) == []
    assert "not checked" in caplog.text and "gcsfs" in caplog.text
