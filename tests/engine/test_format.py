"""The typed manifest format: JSON round trips and the validator on typed objects."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_incremental.core.errors import FormatVersionError, ManifestError
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format import records as fmt
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry
from tests.conftest import small_store

PACK = mf.pack_path("ab" * 16)
A, B = "a" * 32, "b" * 32


def _manifest(**changes: Any) -> Manifest:
    base = ChunkRecipe(kind="z", pack=PACK, offset=0, length=10, size=8, width=4, chain=10)
    delta = ChunkRecipe(
        kind="x", pack=PACK, offset=10, length=5, size=8, width=4, base=A, depth=1, chain=15
    )
    tensor = TensorEntry(
        path="state['w']",
        dtype="float32",
        shape=(2, 2),
        nbytes=16,
        width=4,
        device="cpu",
        numpy=False,
        param=False,
        requires_grad=False,
        chunks=(A, B),
    )
    fields: dict[str, Any] = dict(
        step=3,
        parent=2,
        generation=0,
        since_base=1,
        chunk_size=8,
        created="2024-01-01T00:00:00+00:00",
        audit={"host": "h"},
        stats={"bytes_logical": 16},
        pickled=(),
        tree=["d", [["w", ["t", 0]]]],
        tensors=(tensor,),
        chunks={A: base, B: delta},
        packs={PACK: 15},
    )
    fields.update(changes)
    return Manifest(**fields)


def test_round_trip_through_json_is_identity() -> None:
    manifest = _manifest()
    data = canonical.dumps(manifest)
    again = canonical.loads(data, "test")
    assert again == manifest
    assert canonical.dumps(again) == data
    assert json.loads(data)["version"] == 1  # lossless: readable by every reader


def test_unknown_fields_of_a_newer_writer_are_kept() -> None:
    body = _manifest().to_dict()
    body["future"] = {"x": 1}
    again = canonical.loads(canonical.sign(body), "test")
    assert again.extra == {"future": {"x": 1}}
    assert again.to_dict()["future"] == {"x": 1}


def test_a_saved_manifest_parses_to_typed_records(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save({"w": torch.randn(3000), "n": 1}, 1).wait()
        manifest = store.manifest()
    assert isinstance(manifest.tensors[0], TensorEntry)
    assert all(isinstance(r, ChunkRecipe) for r in manifest.chunks.values())
    assert manifest.lossless and manifest.lossy_tensors == []
    stored = json.loads(open(f"{local_url}/{mf.manifest_path(1)}", "rb").read())
    stored.pop("checksum")
    assert manifest.to_dict() == stored


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["packs"].update({"../etc/passwd": {"size": 1}}), "outside the store"),
        (lambda d: d["packs"].update({"s3://other/x": {"size": 1}}), "outside the store"),
        (lambda d: d["chunks"][A].update(pack="/abs/path"), "outside the store"),
        (lambda d: d["chunks"][A].update(kind="q"), "unknown chunk encoding"),
        (lambda d: d["chunks"][B].update(base="c" * 32), "lacks its base"),
        (lambda d: d["chunks"][B].update(depth=5), "inconsistent base"),
        (lambda d: d["chunks"][A].update(base=B), "standalone chunk"),
        (lambda d: d["chunks"][A].update(offset=14), "outside its pack"),
        (lambda d: d["chunks"][A].update(width=3), "byte-group width"),
        (lambda d: d["chunks"][A].update(lossless=False), "labelled lossless=False"),
        (lambda d: d["chunks"][A].update(decoded=A), "has a decoded hash"),
        (lambda d: d["tensors"][0].update(nbytes=12), "chunks hold 16 bytes"),
        (lambda d: d["tensors"][0].update(param="yes"), "boolean 'param'"),
        (lambda d: d["tensors"][0].update(chunks=[A, "c" * 32]), "unknown chunk"),
        (lambda d: d.update(step=-1), "negative step"),
        (lambda d: d.update(pickled=[1]), "non-string"),
        (lambda d: d.update(parent="x"), "'parent'"),
    ],
)
def test_the_validator_rejects_hostile_or_broken_manifests(edit: Any, message: str) -> None:
    body = _manifest().to_dict()
    edit(body)
    with pytest.raises(ManifestError, match=message):
        canonical.loads(canonical.sign(body), "test")


def test_checksum_and_version_are_checked() -> None:
    body = _manifest().to_dict()
    data = bytearray(canonical.sign(body))
    data[data.index(b'"step":3') + 7] = ord("4")
    with pytest.raises(ManifestError, match="checksum"):
        canonical.loads(bytes(data), "test")
    with pytest.raises(FormatVersionError, match="upgrade"):
        canonical.loads(canonical.sign({**body, "version": fmt.VERSION + 1}), "test")


def test_a_parsed_manifest_is_reused_only_for_the_same_bytes_and_codecs() -> None:
    from lightning_incremental.core import codecs
    from lightning_incremental.core.codecs import registry

    data = canonical.sign(_manifest().to_dict())
    first = canonical.loads(data, "test")
    assert canonical.loads(data, "test") is first  # the same bytes: checked once
    tampered = bytearray(data)
    tampered[tampered.index(b'"step":3') + 7] = ord("4")
    with pytest.raises(ManifestError, match="checksum"):
        canonical.loads(bytes(tampered), "test")  # other bytes are checked afresh
    registry.unregister("x")  # a kind the manifest names is no longer known
    try:
        with pytest.raises(ManifestError, match="unknown chunk encoding"):
            canonical.loads(data, "test")
    finally:
        registry.register(codecs.XOR)
    assert canonical.loads(data, "test") == first


def test_parsed_manifests_are_kept_within_a_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    canonical.forget_parsed()
    datas = [canonical.sign(_manifest(step=s).to_dict()) for s in range(4)]
    monkeypatch.setattr(canonical, "PARSED_KEEP_BYTES", 2 * max(len(d) for d in datas) + 1)
    first = [canonical.loads(d, "test") for d in datas]
    assert canonical.loads(datas[3], "test") is first[3]  # the newest two are kept
    assert canonical.loads(datas[2], "test") is first[2]
    assert canonical.loads(datas[0], "test") is not first[0]  # older ones parsed again, equal
    assert canonical.loads(datas[0], "test") == first[0]
    sealed, parsed = canonical.seal(first[1], "test")  # sealing keeps the manifest a reader gets
    assert sealed == datas[1] and canonical.loads(sealed, "test") is parsed and parsed == first[1]
    monkeypatch.setattr(canonical, "PARSED_KEEP_BYTES", 0)  # larger than the bound: not kept
    canonical.forget_parsed()
    assert canonical.loads(datas[1], "test") is not canonical.loads(datas[1], "test")


def test_a_signed_body_that_holds_a_checksum_is_signed_again() -> None:
    data = canonical.sign(_manifest().to_dict())
    body = json.loads(data)  # as stored: with its checksum
    body["audit"] = {"host": "other"}
    again = canonical.loads(canonical.sign(body), "test")
    assert again.audit == {"host": "other"}


def test_validate_checks_an_assembled_manifest() -> None:
    broken = _manifest(packs={})
    with pytest.raises(ManifestError, match="unlisted pack"):
        canonical.validate(broken, "test")
    assert canonical.validate(_manifest(), "test") == _manifest()


def test_closure_lists_a_chain_base_first() -> None:
    assert fmt.closure(B, _manifest().chunks) == [A, B]


@pytest.mark.parametrize("cls", [fmt.ChunkRecipe, fmt.PieceEntry, fmt.TensorEntry])
def test_records_are_made_as_the_dataclass_would_make_them(cls: type) -> None:
    """The records' ``__init__`` fills the instance's dictionary directly (the generated one of
    a frozen dataclass calls ``object.__setattr__`` per field): positional, keyword and default
    arguments give the same record as a plain frozen dataclass of the same fields, frozen,
    equal and hashed alike, and a wrong call fails the same way."""
    import dataclasses

    fields = dataclasses.fields(cls)
    reference = dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, f.type, dataclasses.field(default=f.default)) for f in fields],
        frozen=True,
    )
    values = [f"v{i}" for i in range(len(fields))]  # a default too is given another value
    required = [v for v, f in zip(values, fields, strict=True) if f.default is dataclasses.MISSING]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (tuple(values), {}),  # every field, positional
        (tuple(required), {}),  # the defaults
        ((), {f.name: v for f, v in zip(fields, values, strict=True)}),  # by keyword
    ]
    for args, kwargs in calls:
        made, expected = cls(*args, **kwargs), reference(*args, **kwargs)
        assert vars(made) == vars(expected)
        assert list(vars(made)) == [f.name for f in fields]  # in field order, as repr shows
        assert made == cls(*args, **kwargs) and hash(made) == hash(cls(*args, **kwargs))
        assert repr(made) == repr(expected).replace(reference.__qualname__, cls.__qualname__)
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.__setattr__(fields[0].name, "changed")
    assert dataclasses.replace(cls(*values), **{fields[0].name: "r"}) == cls("r", *values[1:])
    for wrong_args, wrong_kwargs in [(tuple(required[:-1]), {}), (tuple(values), {"nope": 1})]:
        with pytest.raises(TypeError) as ours:
            cls(*wrong_args, **wrong_kwargs)
        with pytest.raises(TypeError) as theirs:
            reference(*wrong_args, **wrong_kwargs)
        assert str(ours.value).split("() ", 1)[1] == str(theirs.value).split("() ", 1)[1]


def test_records_of_fields_it_cannot_fill_are_refused() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Listed:
        items: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Keyword:
        a: int = dataclasses.field(kw_only=True)

    for cls in (Listed, Keyword):
        with pytest.raises(TypeError, match=cls.__name__):
            fmt._plain_init(cls)

    @fmt._plain_init
    @dataclasses.dataclass(frozen=True)
    class Named:  # fields named as the generated code's own locals would be
        d: int
        self: int = 2

    assert vars(Named(1)) == {"d": 1, "self": 2} and Named(d=3, self=4).self == 4
