"""What a save of many small tensors costs, counted in operations rather than timed: the
per-chunk and per-tensor steps that tens of thousands of tensors multiply are done once per
pack, per dtype or per batch where they can be.

Each test counts the Python-level calls of one step (or the storage requests) and asserts a
bound that does not grow with the number of tensors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import ManifestError
from lightning_incremental.core.format import canonical, compact, validation
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry
from tests.conftest import assert_state_equal
from tests.engine.gc_counts import collections_started


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


def _chained_manifest(n: int) -> Manifest:
    """Lossless chunks with delta chains, a numpy array and an empty tensor: what the column
    reader takes."""
    m = _many_chunk_manifest(n)
    chunks = dict(m.chunks)
    tensors = list(m.tensors)
    first = tensors[0].chunks[0]
    delta = chunk_hash(b"delta")
    chunks[delta] = ChunkRecipe("pd", chunks[first].pack, 0, 4, 16, 4, first, 1, 20)
    tensors[0] = replace(tensors[0], chunks=(delta,))
    tensors[1] = replace(tensors[1], dtype="<f4", numpy=True, param=False)
    tensors.append(
        TensorEntry("state['empty']", "float32", (0, 3), 0, 4, "cpu", False, False, False, ())
    )
    return replace(m, tensors=tuple(tensors), chunks=chunks)


def _tables(manifest: Manifest) -> tuple[dict[str, Any], Any]:
    doc = json.loads(canonical.dumps(manifest))
    doc.pop("checksum")
    assert compact.is_compact(doc)
    return doc, compact._decoded(doc, "test")[0]


def _full_way(doc: dict[str, Any], tables: Any) -> Manifest:
    document = compact._guarded(lambda: compact._document(doc, tables), "test")
    return validation.parse(document, "test")


def test_the_column_reader_reads_what_the_full_way_reads() -> None:
    from lightning_incremental.core.format import columns

    manifest = _chained_manifest(2000)
    doc, tables = _tables(manifest)
    fast = columns.manifest(doc, tables, "test", compact._document)
    assert fast is not None
    assert fast == _full_way(doc, tables)
    assert fast.tensors == manifest.tensors and dict(fast.chunks) == dict(manifest.chunks)


def _spoilers() -> list[Callable[[dict[str, Any]], None]]:
    def chunks(column: str, index: int, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda t: t["chunks"][column].__setitem__(index, value)

    def tensors(column: str, index: int, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda t: t["tensors"][column].__setitem__(index, value)

    return [
        chunks("offset", 3, -1), chunks("offset", 3, 10**9), chunks("length", 3, True),
        chunks("size", 3, 17), chunks("width", 3, 3), chunks("kind", 3, "nope"),
        chunks("kind", 3, "pd"), chunks("base", 3, 3), chunks("base", 3, 10**6),
        chunks("base", 3, 5), chunks("depth", 3, 1), chunks("pack", 3, 9), chunks("hash", 3, "x"),
        chunks("hash", 3, None), chunks("chain", 3, 1.5),
        lambda t: t["chunks"]["hash"].__setitem__(4, t["chunks"]["hash"][5]),
        lambda t: t["chunks"]["offset"].pop(),
        lambda t: t["chunks"]["decoded"].__setitem__("3", "0" * 32),
        tensors("shape", 2, [True]), tensors("shape", 2, [-4]), tensors("shape", 2, [5]),
        tensors("shape", 2, 4), tensors("nbytes", 2, -16), tensors("nbytes", 2, 15),
        tensors("dtype", 2, "float33"), tensors("dtype", 2, 5), tensors("numpy", 2, 2),
        tensors("param", 2, True), tensors("width", 2, 16), tensors("chunks", 2, [10**6]),
        tensors("chunks", 2, [-1]), tensors("chunks", 2, []), tensors("chunks", 2, [0, 1]),
        tensors("device", 2, None), tensors("path", 2, 7),
        lambda t: t["tensors"]["path"].pop(),
        lambda t: t["packs"].__setitem__(0, ["packs/../x.pack", 10]),
        lambda t: t["packs"].__setitem__(0, [t["packs"][0][0], 1]),
        lambda t: t.__setitem__("pickled", [3]),
    ]  # fmt: skip


@pytest.mark.parametrize("number", range(len(_spoilers())))
def test_the_column_reader_accepts_nothing_the_full_way_refuses(number: int) -> None:
    """Each spoilt table: where the full way refuses it, the column reader declines (and the
    full way's error is the one a reader gets); where it accepts, both read the same."""
    from lightning_incremental.core.format import columns

    doc, tables = _tables(_chained_manifest(1500))
    spoiled = json.loads(json.dumps(tables))
    _spoilers()[number](spoiled)
    fast = columns.manifest(doc, spoiled, "test", compact._document)
    try:
        slow = _full_way(doc, spoiled)
    except ManifestError:
        assert fast is None
    else:
        assert fast is None or fast == slow


@pytest.mark.parametrize("n", [600, 3000])
def test_reading_a_compact_manifest_validates_no_entry_one_by_one(n: int) -> None:
    """Reading a compact manifest (a restore, and every commit's check of its own bytes)
    checks its columns whole: no per-tensor or per-chunk validator runs."""
    data = canonical.dumps(_chained_manifest(n))
    canonical.forget_parsed()
    names = ["_tensor", "_recipe", "_tensor_fast", "_recipe_fast"]
    with ExitStack() as stack:
        calls = [
            stack.enter_context(counting(validation, name))
            for name in names
            if hasattr(validation, name)
        ]
        parsed = canonical.loads(data, "test")
    assert len(parsed.tensors) == n + 1
    assert sum(sum(c.values()) for c in calls) == 0


# ----------------------------------------------------------------------------- saves


def _small_state(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(64) for i in range(n)}}


class _Counted:
    """Counts the calls of named module attributes (functions or classes) for a block."""

    def __init__(self, *targets: tuple[Any, str]) -> None:
        self.targets = [(m, name) for m, name in targets if hasattr(m, name)]
        self.calls: Counter[str] = Counter()

    def __enter__(self) -> Counter[str]:
        self.originals = [getattr(m, name) for m, name in self.targets]
        for (module, name), original in zip(self.targets, self.originals, strict=True):

            def counted(*args: Any, __o: Any = original, __n: str = name, **kw: Any) -> Any:
                self.calls[__n] += 1
                return __o(*args, **kw)

            setattr(module, name, counted)
        return self.calls

    def __exit__(self, *exc: object) -> None:
        for (module, name), original in zip(self.targets, self.originals, strict=True):
            setattr(module, name, original)


def _encoder_targets() -> list[tuple[Any, str]]:
    from lightning_incremental.core.chunks import encode as enc

    targets: list[tuple[Any, str]] = [(enc, "TensorEntry"), (enc, "_encode_task")]
    try:
        from lightning_incremental.core.chunks import small

        targets.append((small, "TensorEntry"))
    except ImportError:
        pass
    return targets


@pytest.mark.parametrize("n", [300, 3000])
def test_saves_of_small_tensors_code_and_record_none_of_them_one_by_one(
    tmp_path: Path, n: int
) -> None:
    """A full save of many small tensors runs no codec task per tensor (each is stored from its
    slab), an unchanged save makes no manifest entry (the parent's are reused), and a save with
    1 % changed codes only the changed ones."""
    state = _small_state(n)
    with CheckpointStore(tmp_path / "s") as store:
        with _Counted(*_encoder_targets()) as full:
            store.save(state, step=1).result()
        with _Counted(*_encoder_targets()) as unchanged:
            store.save(state, step=2).result()
        changed = list(state["model"].values())[::100]
        for t in changed:
            t.add_(1)
        with _Counted(*_encoder_targets()) as some:
            store.save(state, step=3).result()
        assert_state_equal(store.load(3), state)
    assert full["_encode_task"] == 0
    assert unchanged["TensorEntry"] == 0 and unchanged["_encode_task"] == 0
    assert some["_encode_task"] == len(changed)
    assert some["TensorEntry"] == len(changed)


@pytest.mark.parametrize("n", [300, 3000])
def test_snapshot_slabs_are_recycled_whole_not_tensor_by_tensor(tmp_path: Path, n: int) -> None:
    """The delta base keeps and gives back the slab of the small tensors as one buffer: the
    pool is not handed one view per tensor, and the leaves make no tensor view the save does
    not use."""
    from lightning_incremental.core.buffers import BufferPool

    state = _small_state(n)
    with CheckpointStore(tmp_path / "s") as store:
        store.save(state, step=1).result()
        with _Counted((BufferPool, "_give_back_part")) as parts:
            for step in (2, 3, 4):
                store.save(state, step=step).result()
        pool = store._engine.base.pool
        assert pool.nbytes > 0  # a slab came back, and is lent again by the next save
    assert parts["_give_back_part"] == 0


def test_leaves_of_a_slab_make_no_tensor_view_until_one_is_asked_for() -> None:
    """Building 20,000 tensor views of the slab up front was a tenth of a second of every
    save's background work; the save reads the leaves' bytes as numpy slices."""
    import gc

    from lightning_incremental.core.save.snapshot import flatten_state, wait_ready

    state = _small_state(2000)
    flat = flatten_state(state)
    wait_ready(flat)
    gc.collect()
    before = sum(type(o) is torch.Tensor for o in gc.get_objects())
    leaves = flat.leaves
    gc.collect()
    after = sum(type(o) is torch.Tensor for o in gc.get_objects())
    assert after - before < 10
    assert torch.equal(leaves[5].data, state["model"]["layers.0.w5"])  # made when asked


@pytest.mark.parametrize("n", [300, 3000])
def test_the_background_of_a_save_triggers_few_garbage_collections(tmp_path: Path, n: int) -> None:
    """A save makes a few objects per tensor (leaves, manifest records and tables), all of them
    live: each collection they trigger scans them again (a third of sealing a manifest of
    20,000 tensors). Those steps pause collection, so their number does not grow with the
    tensors."""
    import gc

    state = _small_state(n)
    with CheckpointStore(tmp_path / "s") as store:
        for step in (1, 2):
            with collections_started() as started:
                store.save(state, step=step).result()
            assert len(started) <= 12, (step, started)
    assert gc.isenabled()


def test_the_manifest_is_prepared_while_the_packs_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack writes of a save (I/O: a write and an fsync each) and the sealing of its
    manifest (CPU: per tensor) overlap: the tables are complete once the last pack is handed to
    a writer. The manifest itself is still written only after every pack is durable."""
    import threading

    from lightning_incremental.core.commit import committer
    from lightning_incremental.core.format import layout as mf_layout

    state = _small_state(600)
    sealing = threading.Event()
    done_at_seal: list[int] = []
    done_at_manifest: list[int] = []
    done = 0
    lock = threading.Lock()
    with CheckpointStore(tmp_path / "s") as store:
        storage = store.storage
        original_put_parts, original_put = storage.put_parts, storage.put

        def put_parts(path: str, parts: Any, **kw: Any) -> Any:
            nonlocal done
            if not path.startswith(mf_layout.PACK_DIR):
                return original_put_parts(path, parts, **kw)
            sealing.wait(5.0)  # a pack's write ends only once the manifest is being sealed
            result = original_put_parts(path, parts, **kw)
            with lock:
                done += 1
            return result

        def put(path: str, data: Any, **kw: Any) -> Any:
            if path.startswith(mf_layout.MANIFEST_DIR):
                done_at_manifest.append(done)
            return original_put(path, data, **kw)

        seal = committer.canonical.seal

        def sealed(*args: Any, **kwargs: Any) -> Any:
            done_at_seal.append(done)
            sealing.set()
            return seal(*args, **kwargs)

        monkeypatch.setattr(storage, "put_parts", put_parts)
        monkeypatch.setattr(storage, "put", put)
        monkeypatch.setattr(committer.canonical, "seal", sealed)
        result = store.save(state, step=1).result()
    assert done_at_seal == [0]  # sealed before any pack's write had ended
    assert done_at_manifest == [result.objects_written]  # every pack, then the manifest


def test_a_save_resolves_its_stores_location_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save registers itself under its store's location (loads in the process wait for
    it): the local path is resolved (a ``lstat`` per component, milliseconds each while the
    store's writes flush the same disk) once, not inside every save's stall."""
    from lightning_incremental.core.save import inflight

    monkeypatch.setattr(inflight, "_RESOLVED", {})
    resolved: list[str] = []
    realpath = inflight.os.path.realpath
    monkeypatch.setattr(inflight.os.path, "realpath", lambda p: resolved.append(p) or realpath(p))
    state = {"w": torch.arange(8.0)}
    with CheckpointStore(tmp_path / "store") as store:
        for step in range(1, 6):
            state["w"].add_(1)
            store.save(state, step).result()
    assert len(resolved) == 1, resolved
    assert inflight.location(tmp_path / "store") == realpath(tmp_path / "store")
    assert inflight.location("relative/x") == realpath("relative/x")  # not remembered
    assert len(inflight._RESOLVED) == 1
