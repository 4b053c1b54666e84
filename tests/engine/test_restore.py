"""Restore: into the caller's tensors, a part of a checkpoint, within bounded memory."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_incremental.core import CheckpointStore, ConfigError, codecs
from lightning_incremental.core.chunks import decode as dec
from lightning_incremental.core.load import pipeline as pipe
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal, small_store, walk_store


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": seed}


def saved_store(url: str, steps: int = 3) -> tuple[CheckpointStore, list[dict]]:
    store = small_store(url)
    states = []
    for step in range(1, steps + 1):
        state = model_state(step)
        states.append({k: v for k, v in state.items()})
        store.save(state, step).wait()
    return store, states


def test_into_decodes_into_the_callers_tensors(tmp_path: Path) -> None:
    store, states = saved_store(str(tmp_path / "s"))
    fresh = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 8))
    live = fresh.state_dict()
    pointers = {k: v.data_ptr() for k, v in live.items()}
    loaded = store.load(into={"model": live})
    assert_state_equal(loaded, states[-1])
    for key, tensor in loaded["model"].items():  # the very same tensors, filled in place
        assert tensor is live[key] and tensor.data_ptr() == pointers[key]
    assert_state_equal(fresh.state_dict(), states[-1]["model"])
    store.close()


def test_into_a_non_contiguous_tensor_and_a_subset(tmp_path: Path) -> None:
    store = small_store(str(tmp_path / "s"))
    weight = torch.randn(40, 30)
    store.save({"w": weight, "b": torch.arange(7)}, 1).wait()
    target = torch.zeros(30, 40).t()  # same shape, transposed memory
    assert not target.is_contiguous()
    loaded = store.load(into={"w": target})
    assert loaded["w"] is target and torch.equal(target, weight)
    assert torch.equal(loaded["b"], torch.arange(7))  # not in `into`: a new tensor
    store.close()


def test_into_checks_every_shape_and_dtype_before_reading(tmp_path: Path) -> None:
    store, _ = saved_store(str(tmp_path / "s"), steps=1)
    wrong = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 9)).state_dict()
    before = OrderedDict((k, v.clone()) for k, v in wrong.items())
    with pytest.raises(ConfigError, match=r"\['model'\]\['2.weight'\].*\[8, 128\].*\[9, 128\]"):
        store.load(into={"model": wrong})
    assert_state_equal(wrong, before)  # untouched: nothing was decoded
    half = {k: v.half() for k, v in before.items()}
    with pytest.raises(ConfigError, match=r"torch.float32.*torch.float16"):
        store.load(into={"model": half})
    store.close()


def test_keys_reads_only_the_objects_of_those_keys(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store, states = saved_store(url, steps=1)
    reads: list[str] = []
    original = LocalStorage.get_view

    def counting(self, path, start=0, end=None):  # type: ignore[no-untyped-def]
        reads.append(path)
        return original(self, path, start, end)

    doc = store.manifest()
    model_packs = {
        doc.chunks[d].pack
        for t in doc.tensors
        if t.path.startswith("state['model']")
        for d in t.chunks
    }
    other_packs = {
        doc.chunks[d].pack
        for t in doc.tensors
        if not t.path.startswith("state['model']")
        for d in t.chunks
    }
    assert other_packs - model_packs, "the test needs optimizer-only packs"
    LocalStorage.get_view = counting  # type: ignore[method-assign]
    try:
        loaded = store.load(keys="model")
    finally:
        LocalStorage.get_view = original  # type: ignore[method-assign]
    assert list(loaded) == ["model"]
    assert_state_equal(loaded["model"], states[0]["model"])
    assert set(reads) <= model_packs
    assert list(store.load(keys=["step", "model"])) == ["model", "step"]
    with pytest.raises(ConfigError, match=r"no top-level key 'weights'.*'model'"):
        store.load(keys=["weights"])
    with pytest.raises(TypeError, match="keys must be"):
        store.load(keys=[1])
    store.close()


def test_restore_holds_a_bounded_window_of_objects(tmp_path: Path) -> None:
    """With a tiny read-ahead, a many-pack checkpoint still restores exactly, and never holds
    more than the window (plus one read) of objects at a time."""
    url = str(tmp_path / "s")
    store = small_store(url, xor_delta=True)
    g = torch.Generator().manual_seed(0)
    base = {f"t{i}": torch.randn(3000, generator=g) for i in range(12)}
    store.save(base, 1).wait()
    changed = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    store.save(changed, 2).wait()
    doc = store.manifest(2)
    assert any(r.base is not None for r in doc.chunks.values()), "needs delta chains"
    peak = 0
    original = pipe._Schedule._release

    def watch(self, link):  # type: ignore[no-untyped-def]
        nonlocal peak
        peak = max(peak, self.held)
        original(self, link)

    pipe._Schedule._release = watch  # type: ignore[method-assign]
    try:
        targets = [np.empty(t.nbytes, np.uint8) for t in doc.tensors]
        pipe.restore_arrays(store.storage, doc, store._pool, "test", targets, read_ahead=20000)
    finally:
        pipe._Schedule._release = original  # type: ignore[method-assign]
    largest = max(
        end - start
        for _, start, end, _ in dec.ObjectReader(store.storage, doc, "t").plan(set(doc.chunks))
    )
    assert 0 < peak <= 20000 + 2 * largest
    for entry, raw in zip(doc.tensors, targets):
        key = entry.path[len("state['") : -2]
        assert raw.tobytes() == changed[key].numpy().tobytes()
    store.close()


def test_first_save_after_a_restore_writes_deltas_with_bases_read_from_storage(
    tmp_path: Path,
) -> None:
    """No copy of the state is kept after a restore: the next save decodes its XOR bases from
    the stored checkpoint, chunk by chunk — and writes as few bytes as an uninterrupted run."""
    g = torch.Generator().manual_seed(1)
    first = {"w": torch.randn(64, 1024, generator=g)}
    second = {"w": first["w"] + 1e-4 * torch.randn(64, 1024, generator=g)}

    def two_saves(url: str, reopen: bool) -> int:
        store = small_store(url, chunk_size=16384, pack_size=1 << 20)
        store.save(first, 1).wait()
        if reopen:
            store.close()
            store = small_store(url, chunk_size=16384, pack_size=1 << 20)
            assert_state_equal(store.load(), first)
        written = store.save(second, 2).wait().bytes_written
        assert_state_equal(store.load(2), second)
        doc = store.manifest(2)
        store.close()
        assert all(doc.chunks[d].base is not None for d in doc.tensors[0].chunks)
        return written

    uninterrupted = two_saves(str(tmp_path / "a"), reopen=False)
    restored = two_saves(str(tmp_path / "b"), reopen=True)
    assert restored == uninterrupted
    plain = small_store(
        str(tmp_path / "c"), chunk_size=16384, pack_size=1 << 20, xor_base_from_storage=False
    )
    plain.save(first, 1).wait()
    plain.close()
    plain = small_store(
        str(tmp_path / "c"), chunk_size=16384, pack_size=1 << 20, xor_base_from_storage=False
    )
    plain.load()
    assert plain.save(second, 2).wait().bytes_written > 1.1 * restored  # standalone chunks
    plain.close()


@pytest.mark.parametrize("links", [1, 2, 3, 4])
def test_chains_decode_link_by_link_as_by_planes(tmp_path: Path, links: int) -> None:
    """The link-by-link decoding (each link against the previous result, alternating between
    the output and one scratch buffer) gives the chunk exactly, for odd and even chain lengths,
    as the XOR-of-planes decoding does."""
    store, _ = walk_store(str(tmp_path / "s"), links)
    doc = store.manifest()
    reader = dec.ObjectReader(store.storage, doc, "t")
    for plan in reader.plan(set(doc.chunks)):
        reader.read(plan)
    lengths = set()
    for entry in doc.tensors:
        for digest in entry.chunks:
            chain = dec.closure(digest, doc.chunks)
            lengths.add(len(chain))
            size = doc.chunks[digest].size
            by_links = np.full(size, 7, dtype=np.uint8)
            dec._decode_links(chain, doc.chunks, reader.blobs, by_links, "t")
            whole = np.zeros(size, dtype=np.uint8)
            dec.decode_chunk(digest, doc.chunks, reader.blobs, whole, "t")
            assert dec.chunk_hash(by_links) == doc.chunks[digest].expected(digest)
            assert by_links.tobytes() == whole.tobytes()
    assert links in lengths
    store.close()


def test_a_chunk_several_destinations_want_is_decoded_once(tmp_path: Path) -> None:
    """Two targets of the same chunks (and one tensor holding the same chunk twice): each chunk
    is decoded once and copied to every destination."""
    store, state = walk_store(str(tmp_path / "s"), 2)
    doc = store.manifest()
    entry = doc.tensors[0]
    calls: list[str] = []
    original = pipe.decode_chunk

    def counting(digest, *args):  # type: ignore[no-untyped-def]
        calls.append(digest)
        original(digest, *args)

    a, b = (np.zeros(entry.nbytes, np.uint8) for _ in range(2))
    doubled = np.zeros(2 * entry.nbytes, np.uint8)
    items = [
        pipe.ChunkTarget(entry.chunks, a),
        pipe.ChunkTarget(entry.chunks, b),
        pipe.ChunkTarget(entry.chunks + entry.chunks, doubled),
    ]
    pipe.decode_chunk = counting  # type: ignore[assignment]
    try:
        pipe.restore_chunks(store.storage, doc, store._pool, "t", items)
    finally:
        pipe.decode_chunk = original  # type: ignore[assignment]
    assert sorted(calls) == sorted(set(entry.chunks))
    expect = state[entry.path[len("state['") : -2]].numpy().tobytes()
    assert a.tobytes() == b.tobytes() == expect
    assert doubled.tobytes() == expect * 2
    store.close()


def test_scratch_buffers_are_reused_per_thread_up_to_a_size() -> None:
    scratch = dec._Scratch()
    first = scratch.get(0, 1000)
    assert np.shares_memory(scratch.get(0, 800), first)  # reused, smaller views of it
    assert not np.shares_memory(scratch.get(1, 1000), first)  # another slot, another buffer
    assert scratch.get(0, 2000).size == 2000  # grown
    big = dec.KEEP_MAX + 16
    assert not np.shares_memory(scratch.get(2, big), scratch.get(2, big))  # not kept
    assert all(b is None or b.size <= dec.KEEP_MAX for b in scratch.buffers)


def test_sparse_update_chains_are_xor_and_restore_by_planes(tmp_path: Path) -> None:
    """Rows of an embedding updated here and there: XOR codes them as small as the arithmetic
    predictors, so the chunks chain by XOR, and a chain decodes in one pass (its links' planes
    XORed, ungrouped once), equal to the link-by-link decoding and to the state saved."""
    store = small_store(str(tmp_path / "s"), xor_delta=True, max_chain_ratio=100.0)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(512, 64, generator=g)
    for step in range(1, 6):
        rows = torch.randint(0, 512, (8,), generator=g)
        table = table.clone()
        table[rows] += 1e-2 * torch.randn(8, 64, generator=g)
        store.save({"emb": table}, step).wait()
    doc = store.manifest()
    deltas = [r for r in doc.chunks.values() if r.base is not None]
    assert deltas and max(r.depth for r in deltas) >= 3
    reader = dec.ObjectReader(store.storage, doc, "t")
    for plan in reader.plan(set(doc.chunks)):
        reader.read(plan)
    for digest in doc.tensors[0].chunks:
        chain = dec.closure(digest, doc.chunks)
        if len(chain) < 2:
            continue
        for link in chain:
            payload = reader.blobs[link]
            assert codecs.planes.header(payload)["predictor"] in (
                codecs.predict.NONE,
                codecs.predict.XOR,
            )
        size = doc.chunks[digest].size
        folded = np.zeros(size, dtype=np.uint8)
        width = doc.chunks[digest].width
        assert dec._decode_planes(chain, doc.chunks, reader.blobs, folded, width, "t")
        by_links = np.zeros(size, dtype=np.uint8)
        dec._decode_links(chain, doc.chunks, reader.blobs, by_links, "t")
        assert folded.tobytes() == by_links.tobytes()
    assert torch.equal(store.load()["emb"], table)
    store.close()


def test_dense_updates_keep_the_arithmetic_predictor_and_restore_link_by_link(
    tmp_path: Path,
) -> None:
    store, state = walk_store(str(tmp_path / "s"), 3)
    doc = store.manifest()
    reader = dec.ObjectReader(store.storage, doc, "t")
    for plan in reader.plan(set(doc.chunks)):
        reader.read(plan)
    predictors = {
        codecs.planes.header(reader.blobs[d])["predictor"]
        for d, r in doc.chunks.items()
        if r.base is not None
    }
    assert codecs.predict.SUB in predictors  # wins by more than the XOR margin
    loaded = store.load()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    store.close()


def test_many_small_tensors_decode_in_few_pool_tasks(tmp_path: Path) -> None:
    """3,000 small tensors: the restore hands the pool a task per read and per batch of ready
    chunks, not one per chunk (a task per 4 KiB chunk costs more than its decode, and the
    loop over running tasks grew with their number)."""
    from concurrent.futures import Executor, Future

    class Counting(Executor):
        def __init__(self, inner: Executor) -> None:
            self.inner, self.tasks = inner, 0

        def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[no-untyped-def, override]
            self.tasks += 1
            return self.inner.submit(fn, *args, **kwargs)

    store = small_store(str(tmp_path / "s"))
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(64, generator=g) for i in range(3000)}
    store.save(state, 1).wait()
    doc = store.manifest(1)
    reads = dec.ObjectReader(store.storage, doc, "t").plan(set(doc.chunks))
    pool = Counting(store._pool)
    targets = [np.empty(t.nbytes, np.uint8) for t in doc.tensors]
    pipe.restore_arrays(store.storage, doc, pool, "test", targets)  # type: ignore[arg-type]
    assert pool.tasks <= 2 * len(reads) + len(doc.chunks) // pipe.BATCH_JOBS + 1, pool.tasks
    for entry, raw in zip(doc.tensors, targets):
        assert raw.tobytes() == state[entry.path[len("state['") : -2]].numpy().tobytes()
    store.close()
