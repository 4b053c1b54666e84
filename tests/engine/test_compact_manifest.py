"""The compact manifest (format version 4): the same content as the JSON form, validated the
same way, refused the same way when tampered, and a few tens of bytes per tensor — an unchanged
save of 20,000 tensors writes at most 64 bytes of manifest per tensor."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import FormatVersionError, ManifestError
from lightning_incremental.core.format import canonical, compact
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format import records as fmt
from lightning_incremental.core.format.records import (
    ChunkRecipe,
    Manifest,
    PieceEntry,
    TensorEntry,
)

PACKS = [mf.pack_path(f"{i:02x}" * 16) for i in range(3)]


def _digest(n: int) -> str:
    return chunk_hash(n.to_bytes(8, "little"))


def _manifest(tensors: int = 3, **changes: Any) -> Manifest:
    """Every feature the format has: chains of deltas, a lossy chunk and its delta, a numpy
    array, a sharded tensor's pieces, a chunk two tensors share, fields of a newer writer."""
    chunks: dict[str, ChunkRecipe] = {}
    entries = []
    offset = 0
    for i in range(tensors):
        base, delta = _digest(2 * i), _digest(2 * i + 1)
        chunks[base] = ChunkRecipe("z", PACKS[i % 3], offset, 10, 8, 4, chain=10)
        chunks[delta] = ChunkRecipe("x", PACKS[i % 3], offset + 10, 5, 8, 4, base, 1, 15)
        offset += 15
        entries.append(
            TensorEntry(
                f"state['layers.{i}.w']", "float32", (4,), 16, 4, "cpu", False, True, i % 2 == 0,
                (base, delta),
            )
        )  # fmt: skip
    lossy, lossy_delta = _digest(10**6), _digest(10**6 + 1)
    chunks[lossy] = ChunkRecipe("l8", PACKS[0], 0, 4, 8, 4, lossless=False, decoded=_digest(7))
    chunks[lossy_delta] = ChunkRecipe(
        "l8d", PACKS[0], 4, 4, 8, 4, lossy, 1, 8, lossless=False, decoded=_digest(8)
    )
    first = entries[0].chunks[0]
    entries.append(
        TensorEntry(
            "state['exp_avg']",
            "float32",
            (4,),
            16,
            4,
            "cpu",
            False,
            False,
            False,
            (lossy, lossy_delta),
        )
    )
    entries.append(
        TensorEntry("state['np']", "float64", (1,), 8, 8, "cpu", True, False, False, (first,))
    )
    p0, p1 = (
        PieceEntry((0, 0), (1, 2), (first,)),
        PieceEntry((1, 0), (1, 2), (entries[1].chunks[0],)),
    )
    entries.append(
        TensorEntry(
            "state['sharded']", "float32", (2, 2), 16, 4, "cpu", False, True, True,
            (first, entries[1].chunks[0]), (p0, p1),
        )
    )  # fmt: skip
    fields: dict[str, Any] = dict(
        step=7, parent=6, generation=2, since_base=3, chunk_size=8,
        created="2026-12-04T00:00:00+00:00", audit={"host": "h", "meta": {"lr": 0.1}},
        stats={"bytes_logical": 16}, pickled=("state['opt']",),
        tree=["d", [["w", ["t", 0]]]], tensors=tuple(entries), chunks=chunks,
        packs={p: 10**6 for p in PACKS}, extra={"future": {"x": [1, 2]}},
    )  # fmt: skip
    fields.update(changes)
    return Manifest(**fields)


@pytest.fixture
def always_compact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compact, "COMPACT_FROM", 0)


def _as_read(manifest: Manifest) -> Manifest:
    return dataclasses.replace(manifest, version=fmt.COMPACT_VERSION)


def test_the_compact_form_round_trips_every_feature(always_compact: None) -> None:
    manifest = _manifest()
    data = canonical.dumps(manifest)
    header = json.loads(data)
    assert compact.is_compact(header) and header["version"] == fmt.COMPACT_VERSION
    assert header["step"] == 7 and header["parent"] == 6, "what a person looks for, in the clear"
    canonical.forget_parsed()
    again = canonical.loads(data, "test")
    assert again == _as_read(manifest)
    assert again.to_dict() == manifest.to_dict(), "the JSON form is what it was"
    assert canonical.dumps(again) == data, "written again: the same bytes"
    sealed, parsed = canonical.seal(manifest, "test")
    assert sealed == data and parsed == again


@settings(max_examples=25, deadline=None)
@given(tensors=st.integers(2, 40), step=st.integers(0, 10**6), parent=st.none() | st.integers(0))
def test_any_manifest_reads_back_the_same_in_both_forms(tensors: int, step: int, parent) -> None:  # type: ignore[no-untyped-def]
    manifest = _manifest(tensors, step=step, parent=parent)
    plain = canonical.sign(manifest.to_dict())
    packed = canonical.sign(compact.encode(manifest))
    canonical.forget_parsed()
    assert canonical.loads(packed, "c") == _as_read(canonical.loads(plain, "j"))


def test_small_manifests_stay_json_for_earlier_readers() -> None:
    data = canonical.dumps(_manifest())
    assert json.loads(data)["version"] == fmt.PIECES_VERSION


def _retabled(data: bytes, edit: Callable[[dict[str, Any]], Any]) -> bytes:
    """``data`` with its tables edited and its checksum made right again: only validation can
    refuse it."""
    doc = json.loads(data)
    doc.pop("checksum")
    frame = base64.b64decode(doc["tables"]["data"])
    tables = json.loads(zstandard.ZstdDecompressor().decompress(frame))
    edit(tables)
    plain = compact._canonical(tables)
    frame = zstandard.ZstdCompressor().compress(plain)
    doc["tables"].update(size=len(plain), data=base64.b64encode(frame).decode())
    return canonical.sign(doc)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t["packs"].append(["../etc/passwd", 1]), "outside the store"),
        (lambda t: t["chunks"]["pack"].__setitem__(0, 99), "malformed"),
        (lambda t: t["chunks"]["base"].__setitem__(1, 10**6), "malformed"),
        (lambda t: t["chunks"]["base"].__setitem__(1, True), "malformed"),
        (lambda t: t["chunks"]["kind"].__setitem__(0, "?"), "unknown chunk encoding"),
        (lambda t: t["chunks"]["offset"].__setitem__(0, 10**7), "outside its pack"),
        (lambda t: t["chunks"]["hash"].__setitem__(1, t["chunks"]["hash"][0]), "listed twice"),
        (lambda t: t["chunks"]["decoded"].clear(), "labelled lossless=True"),
        (lambda t: t["tensors"]["chunks"][0].append(-1), "malformed"),
        (lambda t: t["tensors"]["nbytes"].__setitem__(0, 12), "chunks hold 16 bytes"),
        (lambda t: t["tensors"]["param"].__setitem__(0, 2), "malformed"),
        (lambda t: t["tensors"]["pieces"].clear(), "malformed"),
        (lambda t: t["tensors"].pop("dtype"), "malformed"),
        (lambda t: t.update(pickled=[1]), "non-string"),
        (lambda t: t.update(tables=None) or t.pop("chunks"), "malformed"),
    ],
)
def test_tampered_tables_are_refused_as_a_json_manifest_is(
    always_compact: None, edit: Any, message: str
) -> None:
    data = _retabled(canonical.dumps(_manifest()), edit)
    with pytest.raises(ManifestError, match=message):
        canonical.loads(data, "test")


def test_a_flipped_bit_anywhere_fails_the_checksum(always_compact: None) -> None:
    data = canonical.dumps(_manifest())
    start = data.index(b'"data":"') + 8
    for at, new in ((data.index(b'"step":7') + 7, "8"), (start + 20, "A"), (len(data) - 99, "B")):
        tampered = bytearray(data)
        tampered[at] = ord(new) if tampered[at] != ord(new) else ord("C")
        with pytest.raises(ManifestError, match="checksum"):
            canonical.loads(bytes(tampered), "test")


def test_a_newer_version_and_lying_tables_are_refused(always_compact: None) -> None:
    doc = json.loads(canonical.dumps(_manifest()))
    doc.pop("checksum")
    with pytest.raises(FormatVersionError, match="upgrade"):
        canonical.loads(canonical.sign({**doc, "version": fmt.VERSION + 1}), "test")
    tables = doc["tables"]
    for changed, message in (
        ({"size": 1 << 40}, "not decompressed"),  # never allocated: refused before decompressing
        ({"size": tables["size"] - 1}, "do not hold"),
        ({"encoding": "zstd+msgpack"}, "known encoding"),
        ({"data": "!!"}, "malformed"),
        ({"data": base64.b64encode(b"not zstd").decode()}, "malformed"),
    ):
        body = {**doc, "tables": {**tables, **changed}}
        with pytest.raises(ManifestError, match=message):
            canonical.loads(canonical.sign(body), "test")


def test_an_earlier_reader_is_told_to_upgrade(always_compact: None) -> None:
    """A release that reads up to version 3 sees a version it does not know, not a corrupt
    checkpoint: the compact form is JSON with its version in the clear."""
    from lightning_incremental.core.format import validation

    data = canonical.dumps(_manifest())
    doc = json.loads(data)
    with pytest.raises(FormatVersionError, match="upgrade"):
        original = validation.VERSION
        validation.VERSION = fmt.PIECES_VERSION  # what the earlier release compares against
        try:
            validation.check_version(doc, "test")
        finally:
            validation.VERSION = original


def _manifest_bytes(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / "manifests").glob(f"{step:020d}*"))


def test_an_unchanged_save_of_20000_tensors_writes_at_most_64_bytes_per_tensor(
    tmp_path: Path,
) -> None:
    """The JSON form wrote about 440 bytes per tensor on every save, changed or not."""
    g = torch.Generator().manual_seed(0)
    n = 20_000
    state = {
        f"model.layers.{i // 64}.experts.{i % 64}.w": torch.randn(64, generator=g) for i in range(n)
    }
    with CheckpointStore(tmp_path) as store:
        store.save(state, 1).wait()
        store.save(state, 2).wait()
        version = store.manifest(2).version
    assert _manifest_bytes(tmp_path, 2) <= 64 * n, _manifest_bytes(tmp_path, 2) / n
    assert version == fmt.COMPACT_VERSION
    canonical.forget_parsed()
    with CheckpointStore(tmp_path) as store:
        out = store.load(2)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_store_of_both_forms_reads_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old manifests still load: a chain whose first steps were written as JSON goes on in
    the compact form and every step restores and verifies."""
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(256, generator=g) for i in range(8)}
    with CheckpointStore(tmp_path) as store:
        store.save(state, 1).wait()
        monkeypatch.setattr(compact, "COMPACT_FROM", 0)
        state = {k: v + 1 for k, v in state.items()}
        store.save(state, 2).wait()
        assert [store.manifest(s).version for s in (1, 2)] == [1, fmt.COMPACT_VERSION]
        assert store.verify(2).ok and store.verify(1).ok
    canonical.forget_parsed()
    with CheckpointStore(tmp_path) as store:
        out = store.load(2)
    assert all(torch.equal(out[k], v) for k, v in state.items())
