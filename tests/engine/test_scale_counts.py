"""What a save of many small tensors costs, counted in operations rather than timed: the
per-chunk and per-tensor steps that tens of thousands of tensors multiply are done once per
pack, per dtype or per batch where they can be.

Each test counts the Python-level calls of one step (or the storage requests) and asserts a
bound that does not grow with the number of tensors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import ManifestError
from lightning_incremental.core.format import canonical, compact, validation
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry


@contextmanager
def counting(module: Any, name: str) -> Iterator[Counter[str]]:
    """Count the calls of ``module.name`` (a module-level function) while the block runs."""
    calls: Counter[str] = Counter()
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def _many_chunk_manifest(n: int, packs: int = 2) -> Manifest:
    paths = [mf.pack_path(f"{i:02x}" * 16) for i in range(packs)]
    chunks: dict[str, ChunkRecipe] = {}
    tensors = []
    for i in range(n):
        digest = chunk_hash(i.to_bytes(8, "little"))
        chunks[digest] = ChunkRecipe("p", paths[i % packs], 16 * (i // packs), 16, 16, 4)
        dtype = "float32" if i % 2 else "bfloat16"
        shape = (4,) if i % 2 else (8,)
        tensors.append(
            TensorEntry(f"state['w{i}']", dtype, shape, 16, 4, "cpu", False, True, False, (digest,))
        )
    return Manifest(
        step=1, generation=0, since_base=0, chunk_size=4 << 20, created="now",
        tensors=tuple(tensors), chunks=chunks,
        packs={p: 16 * (n // packs + 1) for p in paths},
    )  # fmt: skip


@pytest.mark.parametrize("n", [100, 3000])
def test_a_manifest_is_validated_with_a_check_per_pack_and_dtype_not_per_entry(n: int) -> None:
    """Every chunk names its pack and every tensor its dtype: validating each one's path (a
    regular expression) and dtype (a torch lookup) again per entry was a large part of the
    check every commit makes of its own manifest. They are checked once per distinct value."""
    manifest = _many_chunk_manifest(n)
    doc = json.loads(canonical.dumps(manifest))
    doc.pop("checksum")
    expanded, _ = compact.expand(doc, "test") if compact.is_compact(doc) else (doc, 0)
    with counting(validation, "check_path") as paths, counting(validation, "_itemsize") as sizes:
        parsed = validation.parse(expanded, "test")
    assert parsed.tensors == manifest.tensors
    assert dict(parsed.chunks) == dict(manifest.chunks)
    assert paths["check_path"] <= 2  # the packs table's two paths
    assert sizes["_itemsize"] <= 2  # two dtypes


def test_the_fast_checks_refuse_what_the_full_checks_refuse() -> None:
    """A recipe or tensor the fast path does not take is handed to the full check, which names
    the problem: a bad entry is as much an error as before."""
    manifest = _many_chunk_manifest(40)
    good = json.loads(json.dumps(manifest.to_dict()))
    bad_cases: list[Callable[[dict[str, Any]], None]] = [
        lambda d: next(iter(d["chunks"].values())).update(pack="packs/../x.pack"),
        lambda d: next(iter(d["chunks"].values())).update(offset=-1),
        lambda d: next(iter(d["chunks"].values())).update(width=True),
        lambda d: next(iter(d["chunks"].values())).update(kind="nope"),
        lambda d: next(iter(d["chunks"].values())).update(base=next(iter(d["chunks"]))),
        lambda d: d["tensors"][0].update(shape=[True, 4]),
        lambda d: d["tensors"][0].update(nbytes=17),
        lambda d: d["tensors"][0].update(dtype="float33"),
        lambda d: d["tensors"][0].update(numpy=1),
        lambda d: d["tensors"][0].update(chunks=["0" * 32]),
        lambda d: d["tensors"][0].update(param=1),
    ]
    for spoil in bad_cases:
        doc = json.loads(json.dumps(good))
        spoil(doc)
        with pytest.raises(ManifestError):
            validation.parse(doc, "test")
