"""Corrupt, missing and hostile objects in a local store with a delta-chained history.

The promise under test: restore never returns wrong bytes. A checkpoint whose objects are damaged
is refused with an error naming the object; ``load()`` falls back to the newest intact checkpoint
with a warning naming what was bad (or raises when none is intact); ``verify`` names the bad
object. A manifest that was modified, or forged with a valid checksum to point outside the store,
to a newer format or to a pickle, is rejected by validation.

Which checkpoints a damaged object breaks is computed independently from the manifests (each is
self-contained: its chunk table holds every chunk its tensors need, delta bases included).
"""

from __future__ import annotations

import base64
import json
import pathlib
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    FormatVersionError,
    ManifestError,
    PickleNotAllowedError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format import records as fmt
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal, small_store

STEPS = (1, 2, 3, 4)
FALLBACK = re.compile(r"checkpoint step (\d+) in .* is unusable")


def history() -> dict[int, dict[str, Any]]:
    """Four states of a training run: a dense small update of ``w`` (XOR deltas), a sparse update
    of ``emb`` (one chunk changes), a frozen tensor (reused), plain values."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(64, 64, generator=g)
    frozen = torch.randn(2048, generator=g)
    emb = torch.randn(128, 32, generator=g)
    states = {}
    for step in STEPS:
        if step > 1:
            w = w + 1e-3 * torch.randn(w.shape, generator=g)
            emb = emb.clone()
            emb[20 * step] += 1.0
        states[step] = {
            "model": {"w": w.clone(), "frozen": frozen.clone(), "emb": emb.clone()},
            "optim": {"lr": 0.1 / step, "betas": (0.9, 0.999)},
            "step": step,
        }
    return states


@dataclass
class History:
    url: str
    root: pathlib.Path
    states: dict[int, dict[str, Any]]
    docs: dict[int, dict[str, Any]]  # parsed manifests, checksum removed

    def store(self, **options: Any) -> CheckpointStore:
        return small_store(self.url, **options)

    def path(self, relative: str) -> pathlib.Path:
        return self.root.joinpath(*relative.split("/"))


@pytest.fixture
def hist(tmp_path: pathlib.Path) -> History:
    root = tmp_path / "store"
    states = history()
    with small_store(str(root)) as store:
        results = [store.save(states[step], step).wait() for step in STEPS]
    assert results[0].full_base and not any(r.full_base for r in results[1:])
    assert sum(r.chunks_delta for r in results) > 0, "the history must hold XOR deltas"
    assert sum(r.chunks_reused for r in results) > 0, "the history must reuse chunks"
    storage = LocalStorage(str(root))
    docs = {s: canonical.loads(storage.get(mf.manifest_path(s)), str(s)).to_dict() for s in STEPS}
    assert any(r["depth"] >= 2 for r in docs[4]["chunks"].values()), "want a chain of deltas"
    return History(str(root), root, states, docs)


def test_intact_history_verifies_and_restores(hist: History) -> None:
    with hist.store() as store:
        assert store.steps() == list(STEPS)
        for step in STEPS:
            report = store.verify(step)
            assert report.ok, report
            assert report.chunks_checked == len(hist.docs[step]["chunks"])
            assert [o.path for o in report.objects] == sorted(hist.docs[step]["packs"])
            assert_state_equal(store.load(step), hist.states[step])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_state_equal(store.load(), hist.states[4])


# ---------------------------------------------------------------------------- damaged packs


def _target(hist: History, which: str) -> tuple[str, dict[str, Any]]:
    """A (pack, chunk recipe) to damage: a chunk only the newest checkpoint needs, a delta
    written by step 2 that the later chains build on, or a chunk of step 1 every step needs."""
    docs = hist.docs
    if which == "newest":
        digests = [d for d in docs[4]["chunks"] if d not in docs[3]["chunks"]]
    elif which == "middle":
        digests = [
            d
            for d in docs[2]["chunks"]
            if d not in docs[1]["chunks"] and d in docs[3]["chunks"] and d in docs[4]["chunks"]
        ]
    else:
        digests = [d for d in docs[1]["chunks"] if all(d in docs[s]["chunks"] for s in STEPS)]
    assert digests, f"the history has no {which} chunk to damage"
    recipe = docs[4]["chunks"].get(digests[0]) or docs[2]["chunks"][digests[0]]
    return recipe["pack"], recipe


def _damage(hist: History, how: str, pack: str, recipe: dict[str, Any]) -> tuple[int, float]:
    """Damage ``pack`` on disk; the damaged byte range [start, end)."""
    file = hist.path(pack)
    data = bytearray(file.read_bytes())
    if how == "bitflip":
        at = recipe["offset"] + recipe["length"] // 2
        data[at] ^= 0x10
        file.write_bytes(bytes(data))
        return at, at + 1
    if how == "truncate":
        cut = recipe["offset"] + 1
        file.write_bytes(bytes(data[:cut]))
        return cut, float("inf")
    assert how == "delete"
    file.unlink()
    return 0, float("inf")


def _needs(doc: dict[str, Any], pack: str, start: int, end: float) -> bool:
    """Whether restoring ``doc`` reads any byte of ``pack`` in [start, end)."""
    return any(
        r["pack"] == pack and r["offset"] < end and start < r["offset"] + r["length"]
        for r in doc["chunks"].values()
    )


@pytest.mark.parametrize("how", ["bitflip", "truncate", "delete"])
@pytest.mark.parametrize("which", ["newest", "middle", "base"])
def test_damaged_pack(hist: History, which: str, how: str) -> None:
    pack, recipe = _target(hist, which)
    start, end = _damage(hist, how, pack, recipe)
    broken = {s for s in STEPS if _needs(hist.docs[s], pack, start, end)}
    listed = {s for s in STEPS if pack in hist.docs[s]["packs"]}
    if which == "newest":
        assert broken == {4}
    elif which == "middle":
        assert 1 not in broken and {2, 3, 4} <= broken
    else:
        assert broken == set(STEPS)
    problem = {"bitflip": "", "truncate": "truncated", "delete": "missing"}[how]
    verify_problem = {"bitflip": "content hash", "truncate": "size", "delete": "missing"}[how]

    with hist.store() as store:
        for step in STEPS:
            if step in broken:
                with pytest.raises(CorruptCheckpointError) as raised:
                    store.load(step)
                assert pack in str(raised.value) and f"step {step}" in str(raised.value)
                assert problem in str(raised.value)
            else:  # what it needs is intact: exact bytes
                assert_state_equal(store.load(step), hist.states[step])
            report = store.verify(step)
            if step in listed:
                assert not report.ok
                bad = [o for o in report.objects if not o.ok]
                assert [o.path for o in bad] == [pack]
                assert verify_problem in (bad[0].error or "")
            else:
                assert report.ok, report

    intact = [s for s in STEPS if s not in broken]
    with hist.store() as store:
        if 4 in broken:
            with pytest.raises(CorruptCheckpointError, match=re.escape(pack)):
                store.load(strict=True)
        with pytest.warns(UserWarning) as caught:
            if intact:
                assert_state_equal(store.load(), hist.states[intact[-1]])
            else:
                with pytest.raises(CorruptCheckpointError, match="no intact checkpoint") as none:
                    store.load()
                for step in STEPS:
                    assert f"step {step}" in str(none.value)
                assert pack in str(none.value)
        fallbacks = [str(w.message) for w in caught if FALLBACK.search(str(w.message))]
        skipped = [int(FALLBACK.search(m).group(1)) for m in fallbacks]  # type: ignore[union-attr]
        assert skipped == [s for s in reversed(STEPS) if s > (intact[-1] if intact else 0)]
        assert all(pack in m for m in fallbacks)


def test_resume_after_fallback_and_save_again(hist: History) -> None:
    """The newest checkpoint's own pack is corrupt: a restarted job falls back to step 3, trains
    (deterministically) to step 4 again and saves it. The new step 4 must be intact — even though
    the engine encodes the same bytes into a pack of the same content-addressed name as the
    corrupt object still lying in the store."""
    pack, recipe = _target(hist, "newest")
    _damage(hist, "bitflip", pack, recipe)
    with hist.store() as store:
        with pytest.warns(UserWarning, match="step 4"):
            assert_state_equal(store.load(), hist.states[3])
        store.save(hist.states[4], 4).wait()
    with hist.store() as fresh:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_state_equal(fresh.load(4), hist.states[4])
        assert fresh.verify(4).ok


def test_resume_after_fallback_with_new_state(hist: History) -> None:
    """Same as above with a state that differs from the lost one: the new step 4 is intact and
    builds on step 3 (the newest intact), not on the corrupt one."""
    pack, recipe = _target(hist, "newest")
    _damage(hist, "delete", pack, recipe)
    new4 = history()[4]
    new4["model"]["w"] = new4["model"]["w"] + 1.0
    with hist.store() as store:
        with pytest.warns(UserWarning, match="step 4"):
            store.load()
        store.save(new4, 4).wait()
    with hist.store() as fresh:
        assert fresh.steps() == list(STEPS)
        assert_state_equal(fresh.load(), new4)
        assert fresh.verify(4).ok
        assert pack not in json.loads(fresh.storage.get(mf.manifest_path(4)))["packs"]


def test_missing_manifest_in_the_middle(hist: History) -> None:
    """Manifests are self-contained: losing one leaves the later deltas restorable."""
    hist.path(mf.manifest_path(2)).unlink()
    (hist.root / "manifests" / "notes.txt").write_text("not a manifest")
    (hist.root / "manifests" / ".tmp-0123").write_bytes(b"{")
    with hist.store() as store:
        assert store.steps() == [1, 3, 4]
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            store.load(2)
        for step in (1, 3, 4):
            assert_state_equal(store.load(step), hist.states[step])
            assert store.verify(step).ok


# ---------------------------------------------------------------------------- manifests


def _node(tree: Any, *keys: str) -> list[Any]:
    """The skeleton node at ``keys`` (dict nodes are ``["d", [[key, node], ...]]``)."""
    node = tree
    for key in keys:
        assert node[0] == "d", node
        node = next(value for k, value in node[1] if k == key)
    return node


class _Touch:
    """A pickle payload that creates a file when unpickled: proof of code execution."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.path,))


def _pickle_node(target: pathlib.Path) -> list[Any]:
    blob = pickle.dumps(_Touch(target), protocol=pickle.HIGHEST_PROTOCOL)
    return ["pkl", base64.b64encode(blob).decode("ascii")]


def _rename_pack(doc: dict[str, Any], old: str, new: str) -> None:
    doc["packs"][new] = doc["packs"].pop(old)
    for recipe in doc["chunks"].values():
        if recipe["pack"] == old:
            recipe["pack"] = new


Change = Callable[[History, dict[str, Any], pathlib.Path], bytes]
Mutation = Callable[[dict[str, Any], History, pathlib.Path], None]


@dataclass
class Case:
    """A way to rewrite manifest 4 (given the store, a copy of its body, a scratch directory)
    and the error that loading it must raise."""

    change: Change
    error: type[Exception]
    match: str


def _tamper(mutate: Mutation) -> Change:
    """Modify a value and keep the old checksum (bit rot, a hand edit)."""

    def change(hist: History, doc: dict[str, Any], tmp: pathlib.Path) -> bytes:
        checksum = json.loads(hist.path(mf.manifest_path(4)).read_bytes())["checksum"]
        mutate(doc, hist, tmp)
        return json.dumps({**doc, "checksum": checksum}, sort_keys=True).encode()

    return change


def _forge(mutate: Mutation) -> Change:
    """Modify a value and write a valid checksum: only validation can stop it."""

    def change(hist: History, doc: dict[str, Any], tmp: pathlib.Path) -> bytes:
        mutate(doc, hist, tmp)
        return canonical.sign(doc)

    return change


def _raw(data: Callable[[History], bytes]) -> Change:
    """Replace the manifest's bytes."""
    return lambda hist, doc, tmp: data(hist)


def _manifest_bytes(hist: History, step: int) -> bytes:
    return hist.path(mf.manifest_path(step)).read_bytes()


def _set_lr(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    node = _node(doc["tree"], "optim", "lr")
    assert node[0] == "f"
    node[1] = (0.5).hex()


def _set_shape(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    entry = next(t for t in doc["tensors"] if t["path"].endswith("['emb']"))
    entry["shape"] = list(reversed(entry["shape"]))  # same size: only the checksum sees it


def _shrink_shape(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    entry = next(t for t in doc["tensors"] if t["path"].endswith("['emb']"))
    entry["shape"] = [entry["shape"][0], entry["shape"][1] // 2]


def _outside(kind: str) -> Callable[[dict[str, Any], History, pathlib.Path], None]:
    """Point a pack at a place outside the store. Where a file can exist there, put a valid
    copy of the pack: a store that followed the path would restore correct bytes, so only
    validation makes the load fail."""

    def mutate(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
        old = sorted(set(doc["packs"]) - set(hist.docs[3]["packs"]))[0]  # needed by 4 alone
        name = old.rsplit("/", 1)[-1]
        copy = tmp / "outside" / name
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(hist.path(old), copy)
        new = {
            "dotdot": f"packs/../../outside/{name}",
            "absolute": str(copy),
            "s3": f"s3://bucket/{old}",
            "file-url": f"file://{copy}",
        }[kind]
        _rename_pack(doc, old, new)

    return mutate


def _set_version(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    doc["version"] = fmt.VERSION + 1


def _pickle(listed: bool) -> Callable[[dict[str, Any], History, pathlib.Path], None]:
    def mutate(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
        items = doc["tree"][1]
        index = next(i for i, (k, _) in enumerate(items) if k == "step")
        items[index][1] = _pickle_node(tmp / "executed")
        doc["pickled"] = ["state['step']"] if listed else []

    return mutate


def _offset_outside(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    recipe = doc["chunks"][next(iter(doc["chunks"]))]
    recipe["offset"] = doc["packs"][recipe["pack"]]["size"]


def _swap_chunks(doc: dict[str, Any], hist: History, tmp: pathlib.Path) -> None:
    """Two chunks of one pack trade places: every recipe is plausible, the bytes are wrong."""
    by_pack: dict[str, list[dict[str, Any]]] = {}
    for recipe in doc["chunks"].values():
        by_pack.setdefault(recipe["pack"], []).append(recipe)
    a, b = next(rs for rs in by_pack.values() if len(rs) >= 2)[:2]
    for key in ("offset", "length", "kind", "base", "depth", "chain"):
        a[key], b[key] = b[key], a[key]


CASES: dict[str, Case] = {
    "tampered-float-in-tree": Case(_tamper(_set_lr), ManifestError, "checksum"),
    "tampered-shape": Case(_tamper(_set_shape), ManifestError, "checksum"),
    "forged-dotdot-path": Case(_forge(_outside("dotdot")), ManifestError, "outside the store"),
    "forged-absolute-path": Case(_forge(_outside("absolute")), ManifestError, "outside the store"),
    "forged-s3-scheme": Case(_forge(_outside("s3")), ManifestError, "outside the store"),
    "forged-file-url": Case(_forge(_outside("file-url")), ManifestError, "outside the store"),
    "forged-chunk-outside-pack": Case(_forge(_offset_outside), ManifestError, "outside its pack"),
    "forged-swapped-chunks": Case(_forge(_swap_chunks), CorruptCheckpointError, "chunk "),
    "forged-shape": Case(_forge(_shrink_shape), ManifestError, "wrong size"),
    "newer-format-version": Case(
        _forge(_set_version), FormatVersionError, f"version {fmt.VERSION}"
    ),
    "pickle-listed": Case(_forge(_pickle(True)), PickleNotAllowedError, r"state\['step'\]"),
    "pickle-hidden": Case(_forge(_pickle(False)), PickleNotAllowedError, r"state\['step'\]"),
    "malformed-json": Case(_raw(lambda h: b"{not json"), ManifestError, "not valid JSON"),
    "truncated-json": Case(
        _raw(lambda h: _manifest_bytes(h, 4)[:-50]), ManifestError, "not valid JSON"
    ),
    "empty-file": Case(_raw(lambda h: b""), ManifestError, "not valid JSON"),
    "not-an-object": Case(_raw(lambda h: b"[1, 2]"), ManifestError, "not a JSON object"),
    "step-replayed": Case(_raw(lambda h: _manifest_bytes(h, 3)), ManifestError, "records step 3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_manifest(hist: History, tmp_path: pathlib.Path, case: str) -> None:
    spec = CASES[case]
    doc = json.loads(json.dumps(hist.docs[4]))  # a deep copy to modify
    hist.path(mf.manifest_path(4)).write_bytes(spec.change(hist, doc, tmp_path))
    executed = tmp_path / "executed"

    with hist.store() as store:
        assert store.steps() == list(STEPS)
        with pytest.raises(spec.error, match=spec.match) as raised:
            store.load(4)
        assert "step 4" in str(raised.value)
        for step in (1, 2, 3):
            assert_state_equal(store.load(step), hist.states[step])
            assert store.verify(step).ok

    with hist.store() as store:
        if issubclass(spec.error, CorruptCheckpointError):
            with pytest.raises(spec.error, match=spec.match):
                store.load(strict=True)
            with pytest.warns(UserWarning, match=spec.match) as caught:
                assert_state_equal(store.load(), hist.states[3])
            assert [
                FALLBACK.search(str(w.message)).group(1)
                for w in caught  # type: ignore[union-attr]
                if FALLBACK.search(str(w.message))
            ] == ["4"]
        else:
            # not corrupt: written by a newer library, or holding pickles. Falling back would
            # silently resume from an older checkpoint; the caller must upgrade or opt in.
            with pytest.raises(spec.error, match=spec.match):
                store.load()

    if spec.error is not PickleNotAllowedError:  # verify checks integrity, not pickle policy
        with hist.store() as store:
            report = store.verify(4)
            assert not report.ok
            assert any(re.search(spec.match, e) for e in report.errors), report.errors
    assert not executed.exists(), "the pickle payload was executed"


def test_pickle_payload_is_live(hist: History, tmp_path: pathlib.Path) -> None:
    """Control for the pickle cases: with ``allow_pickle`` the forged payload does run, so the
    cases above prove that loading without it does not."""
    doc = json.loads(json.dumps(hist.docs[4]))
    hist.path(mf.manifest_path(4)).write_bytes(_forge(_pickle(True))(hist, doc, tmp_path))
    with hist.store(allow_pickle=True) as store:
        store.load(4)
    assert (tmp_path / "executed").exists()


def test_every_manifest_damaged(hist: History) -> None:
    for step in STEPS:
        hist.path(mf.manifest_path(step)).write_bytes(b"{}")
    with hist.store() as store:
        with pytest.warns(UserWarning) as caught:
            with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
                store.load()
        steps = [
            FALLBACK.search(str(w.message)).group(1)
            for w in caught  # type: ignore[union-attr]
            if FALLBACK.search(str(w.message))
        ]
        assert steps == ["4", "3", "2", "1"]
        with pytest.raises(CorruptCheckpointError):
            store.load(strict=True)
        for step in STEPS:
            assert not store.verify(step).ok
