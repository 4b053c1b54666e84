"""Sharded tensors in one process: the piece reader (which chunks, where their elements go), the
format's piece table and its validator, and a store round trip of DTensors on a one-process mesh.
Several ranks: tests/multiprocess/test_sharded_torchrun.py."""

from __future__ import annotations

import json
import math
import os

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from lightning_incremental.core import (
    CheckpointStore,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
)
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.format import canonical, validation
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format import records as fmt
from lightning_incremental.core.format.pieces import Box, flat_runs, relative
from lightning_incremental.core.format.records import ChunkRecipe, PieceEntry, TensorEntry
from lightning_incremental.core.load.scatter import direct_chunks, piece_targets
from lightning_incremental.core.load.targets import Regions
from tests.engine.test_pieces import grid, guillotine, region

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


@st.composite
def stored_layout(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    tiling = draw(st.one_of(guillotine(shape), grid(shape))) if shape else [Box((), ())]
    wanted = draw(st.lists(region(shape), min_size=1, max_size=3)) if shape else [Box((), ())]
    return shape, tiling, wanted


@settings(max_examples=300, deadline=None)
@given(stored_layout(), st.sampled_from(DTYPES), st.integers(1, 4))
def test_piece_reader_fills_wanted_boxes_from_only_the_needed_chunks(layout, dtype, per_chunk):
    """Any tiling, any wanted boxes, chunks of any size: the boxes get exactly the stored values,
    and the chunks read are exactly those holding a wanted element (flat_runs, brute force)."""
    shape, tiling, wanted = layout
    # Distinct values (exact in every dtype here: at most 216 elements), so no two pieces hold
    # the same chunks and each decode target below is matched to its own piece.
    full = (torch.randperm(math.prod(shape)) - 108).reshape(shape).to(dtype)
    itemsize = full.element_size()
    chunk_bytes = 16 * per_chunk
    blobs: dict[str, np.ndarray] = {}
    recipes: dict[str, ChunkRecipe] = {}
    pieces = []
    for box in tiling:
        raw = full[box.slices()].contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        hashes = []
        for offset in range(0, raw.size, chunk_bytes):
            data = raw[offset : offset + chunk_bytes]
            digest = chunk_hash(data)
            blobs[digest] = data
            recipes[digest] = ChunkRecipe("z", "p", 0, 0, data.size, 1)
            hashes.append(digest)
        pieces.append(PieceEntry(box.offsets, box.sizes, tuple(hashes)))
    entry = TensorEntry(
        path="state['w']",
        dtype=str(dtype).removeprefix("torch."),
        shape=shape,
        nbytes=full.numel() * itemsize,
        width=1,
        device="cpu",
        numpy=False,
        param=False,
        requires_grad=False,
        chunks=tuple(d for p in pieces for d in p.chunks),
        pieces=tuple(pieces),
    )
    outs = [torch.zeros(box.sizes, dtype=dtype) for box in wanted]
    targets = piece_targets(entry, Regions(tuple(zip(outs, wanted))), recipes)
    for item in targets:
        index = next(i for i, p in enumerate(pieces) if p.chunks == item.chunks)
        box = tiling[index]
        needed = {
            i
            for i in range(len(item.chunks))
            for w in wanted
            if (common := _intersect(box, w)) is not None
            for a, b in flat_runs(box.sizes, relative(common, box))
            if a * itemsize < (i + 1) * chunk_bytes and b * itemsize > i * chunk_bytes
        }
        offset = 0
        direct = item.direct or {}
        for i, digest in enumerate(item.chunks):
            size = recipes[digest].size
            if i in direct:
                direct[i][:] = blobs[digest]
            if item.wanted is None or i in item.wanted:
                if isinstance(item.target, np.ndarray):
                    item.target[offset : offset + size] = blobs[digest]
                else:
                    item.target.put(offset, blobs[digest].copy())
            offset += size
        staged = set(range(len(item.chunks))) if item.wanted is None else set(item.wanted)
        assert staged | set(direct) == needed
    for box, out in zip(wanted, outs):
        expect = full[box.slices()].contiguous()
        assert torch.equal(out.reshape(-1).view(torch.uint8), expect.reshape(-1).view(torch.uint8))


def test_chunks_inside_whole_rows_of_a_destination_are_decoded_into_it():
    """A piece of 8 rows of 4 float32 in chunks of 2 rows: the chunks that lie inside the wanted
    rows map onto their bytes of the destination; a partial row range or a column range does
    not."""
    rows = [32] * 4
    flat = np.arange(4 * 16, dtype=np.uint8)  # the destination's bytes of rows 2..5
    got = direct_chunks((8, 4), rows, 4, Box((2, 0), (4, 4)), flat)
    assert sorted(got) == [1, 2]
    assert got[1].tobytes() == flat[:32].tobytes() and got[2].tobytes() == flat[32:].tobytes()
    assert np.shares_memory(got[1], flat)
    assert sorted(direct_chunks((8, 4), rows, 4, Box((1, 0), (4, 4)), flat)) == [1]
    assert direct_chunks((8, 4), rows, 4, Box((0, 0), (8, 2)), np.zeros(64, np.uint8)) == {}
    whole = direct_chunks((8, 4), rows, 4, Box((0, 0), (8, 4)), np.zeros(128, np.uint8))
    assert sorted(whole) == [0, 1, 2, 3]


def test_resharding_rows_decodes_straight_into_the_destinations():
    """Pieces of 4 rows read into shards of 2 rows (2 -> 4 ranks): every chunk lands in one
    destination's memory, nothing goes through scratch."""
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    recipes: dict[str, ChunkRecipe] = {}
    blobs: dict[str, np.ndarray] = {}
    pieces = []
    for start in (0, 4):
        raw = full[start : start + 4].reshape(-1).view(torch.uint8).numpy().copy()
        hashes = []
        for offset in range(0, raw.size, 32):
            data = raw[offset : offset + 32]
            hashes.append(chunk_hash(data))
            blobs[hashes[-1]] = data
            recipes[hashes[-1]] = ChunkRecipe("z", "p", 0, 0, 32, 4)
        pieces.append(PieceEntry((start, 0), (4, 4), tuple(hashes)))
    entry = TensorEntry(
        path="state['w']", dtype="float32", shape=(8, 4), nbytes=128, width=4, device="cpu",
        numpy=False, param=False, requires_grad=False,
        chunks=tuple(d for p in pieces for d in p.chunks), pieces=tuple(pieces),
    )  # fmt: skip
    outs = [torch.zeros(2, 4) for _ in range(4)]
    items = piece_targets(
        entry, Regions(tuple((o, Box((2 * i, 0), (2, 4))) for i, o in enumerate(outs))), recipes
    )
    for item in items:
        assert not item.wanted and item.direct is not None
        assert sorted(item.direct) == list(range(len(item.chunks)))
        for index, digest in enumerate(item.chunks):
            item.direct[index][:] = blobs[digest]
    assert torch.equal(torch.cat(outs), full)


def _intersect(a: Box, b: Box) -> Box | None:
    from lightning_incremental.core.format.pieces import intersect

    return intersect(a, b) if b.numel else None


# ------------------------------------------------------------------ one-process store


def test_distributed_needs_a_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is up")
    with pytest.raises(ConfigError, match="init_process_group"):
        CheckpointStore(tmp_path, distributed=True)


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _dtensor(full: torch.Tensor, placement: str = "shard"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return distribute_tensor(full, mesh, [Shard(0) if placement == "shard" else Replicate()])


def test_dtensor_state_round_trip_in_one_process(tmp_path, world_of_one):
    w, b = torch.randn(7, 5), torch.randn(3).to(torch.bfloat16)
    state = {"w": _dtensor(w), "b": _dtensor(b, "replicate"), "step": torch.tensor(3.0), "lr": 0.1}
    with CheckpointStore(tmp_path, chunk_size=32) as store:
        store.save(state, 1).wait()
        doc = store.manifest(1)
        assert doc.version == fmt.PIECES_VERSION and doc.sharded
        assert [t.pieces is not None for t in doc.tensors] == [True, True, False]
        loaded = store.load(1)  # no `into`: whole tensors
        assert torch.equal(loaded["w"], w) and torch.equal(loaded["b"], b)
        assert loaded["lr"] == 0.1
        live = {"w": _dtensor(torch.zeros(7, 5)), "b": _dtensor(torch.zeros(3).to(torch.bfloat16))}
        out = store.load(1, into=live)
        assert out["w"] is live["w"] and torch.equal(live["w"].to_local(), w)
        state["w"] = _dtensor(w * 2)
        result = store.save(state, 2).wait()
        assert result.chunks_reused > 0  # the unchanged replicated tensor is referenced
        assert torch.equal(store.load(2)["w"], w * 2)


def test_a_gc_in_the_process_between_a_sharded_part_and_its_commit_commits_nothing_broken(
    tmp_path, world_of_one
):
    """A sharded save cannot hold the location's lock from its part to its commit (the ranks'
    collectives lie between): a compact + gc(keep_last=1) through a second store object of the
    process that runs there deletes objects the part reuses. The coordinator sees that a sweep
    ran and checks them: the step is not committed, said so, and the next save writes them
    again."""
    url = str(tmp_path / "store")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    frozen = torch.randn(4096, generator=g)
    options = {"chunk_size": 1024, "pack_size": 4096, "full_every": 100}
    with (
        CheckpointStore(url, distributed=True, **options) as store,
        CheckpointStore(url, **options) as maintenance,
    ):
        for step in (1, 2):
            w = w + 1e-3 * torch.randn(64, 64, generator=g)
            store.save({"w": _dtensor(w), "frozen": frozen}, step).wait()
        for path in (tmp_path / "store" / "packs").rglob("*.pack"):  # saved hours ago
            os.utime(path, (path.stat().st_atime - 7200, path.stat().st_mtime - 7200))
        gather = store._group.gather

        def maintain_then_gather(record):
            maintenance.compact()  # step 2 as a full base: its old delta objects go
            maintenance.gc(keep_last=1)
            return gather(record)

        store._group.gather = maintain_then_gather
        w3 = w + 1e-3 * torch.randn(64, 64, generator=g)
        with pytest.raises(CorruptCheckpointError, match="deleted by a gc in this process"):
            store.save({"w": _dtensor(w3), "frozen": frozen}, 3).wait()
        store._group.gather = gather
        assert store.steps() == [2]
        store.save({"w": _dtensor(w3), "frozen": frozen}, 4).wait()
        assert store.verify(4).ok
        loaded = store.load(4)
        assert torch.equal(loaded["w"], w3) and torch.equal(loaded["frozen"], frozen)


def test_plain_checkpoint_loads_into_dtensors_and_keeps_version_1(tmp_path, world_of_one):
    w = torch.randn(6, 4)
    with CheckpointStore(tmp_path) as store:
        store.save({"w": w}, 1).wait()
        assert store.manifest(1).version == fmt.LOSSLESS_VERSION
        live = {"w": _dtensor(torch.zeros(6, 4))}
        store.load(1, into=live)
        assert torch.equal(live["w"].full_tensor(), w)
        with pytest.raises(ConfigError, match="not for this model"):
            store.load(1, into={"w": _dtensor(torch.zeros(5, 4))})


def test_distributed_store_of_one_rank(tmp_path, world_of_one):
    w = torch.randn(4, 3)
    with CheckpointStore(tmp_path, distributed=True) as store:
        result = store.save({"w": _dtensor(w), "n": torch.arange(3)}, 5).wait()
        assert result.bytes_logical == w.nbytes + 24
        assert torch.equal(store.load(5)["w"], w)


# ------------------------------------------------------------------ the validator


def _sharded_doc(tmp_path) -> dict:
    with CheckpointStore(tmp_path, chunk_size=32) as store:
        store.save({"w": _dtensor(torch.randn(6, 4))}, 1).wait()
        doc = store.manifest(1).to_dict()
    # two pieces, as two ranks would have written them
    piece = doc["tensors"][0]["pieces"][0]
    chunks = piece["chunks"]
    assert len(chunks) == 3  # 96 bytes in 32-byte chunks: rows 0-1, 2-3, 4-5
    doc["tensors"][0]["pieces"] = [
        {"offsets": [0, 0], "sizes": [2, 4], "chunks": chunks[:1]},
        {"offsets": [2, 0], "sizes": [4, 4], "chunks": chunks[1:]},
    ]
    return doc


def _reparse(doc: dict) -> None:
    canonical.loads(canonical.sign(doc), "test")


def test_validator_accepts_a_tiling_and_rejects_hostile_piece_tables(tmp_path, world_of_one):
    doc = _sharded_doc(tmp_path)
    _reparse(doc)
    pieces = doc["tensors"][0]["pieces"]
    hostile = {
        "overlap": [pieces[0], {**pieces[1], "offsets": [1, 0]}],
        "gap": [pieces[1]],
        "outside": [pieces[0], {**pieces[1], "offsets": [3, 0]}],
        "negative": [{**pieces[0], "offsets": [-1, 0]}, pieces[1]],
        "rank": [{**pieces[0], "offsets": [0]}, pieces[1]],
        "sizes": [{**pieces[0], "sizes": [1, 4]}, pieces[1]],
        "bool": [{**pieces[0], "offsets": [False, 0]}, pieces[1]],
        "twice": [pieces[0], pieces[0], pieces[1]],
        "not a list": {"0": pieces[0]},
    }
    for name, table in hostile.items():
        bad = json.loads(json.dumps(doc))
        bad["tensors"][0]["pieces"] = table
        with pytest.raises(ManifestError):
            _reparse(bad)
        assert name
    old = json.loads(json.dumps(doc))
    old["version"] = fmt.LOSSY_VERSION
    with pytest.raises(ManifestError, match="version"):
        _reparse(old)
    both = json.loads(json.dumps(doc))
    both["tensors"][0]["chunks"] = []
    with pytest.raises(ManifestError, match="chunk list"):
        _reparse(both)
    newer = json.loads(json.dumps(doc))
    newer["version"] = fmt.VERSION + 1
    with pytest.raises(Exception, match="upgrade"):
        _reparse(newer)


def test_piece_arrays_are_keyed_for_the_next_delta(tmp_path, world_of_one):
    doc = validation.parse(_sharded_doc(tmp_path), "test")
    arrays = doc.tensors[0].arrays()
    assert [a.path for a in arrays] == ["state['w']@0,0", "state['w']@2,0"]
    assert [a.nbytes for a in arrays] == [32, 64]
    assert math.prod(doc.tensors[0].shape) * 4 == doc.tensors[0].nbytes
    assert doc.to_dict()["format"] == mf.FORMAT


def test_dcp_export_of_a_non_sharded_checkpoint(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_incremental import cli

    state = {
        "model": {"w": torch.randn(5, 3), "n": torch.arange(4, dtype=torch.int16)},
        "optim": {"step": torch.tensor(7.0), "lr": 0.5, "betas": [0.9, 0.99]},
    }
    with CheckpointStore(tmp_path / "store") as store:
        store.save(state, 3).wait()
    out = tmp_path / "dcp"
    assert cli.main(["export", str(tmp_path / "store"), "--format", "dcp", "--to", str(out)]) == 0
    dcp_to_torch_save(out, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=False)
    assert back["optim"]["lr"] == 0.5 and back["optim"]["betas"] == [0.9, 0.99]
    for key in ("w", "n"):
        assert torch.equal(back["model"][key], state["model"][key])
    assert torch.equal(back["optim"]["step"], state["optim"]["step"])


# ------------------------------------------------------------------ ShardedTensor, compaction


def _sharded_tensor(full: torch.Tensor, rows: tuple[int, ...]):
    """A ``ShardedTensor`` (FSDP1's sharded state dict leaf) of ``full`` cut into row blocks
    starting at ``rows``, every block a local shard of this one process."""
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    stops = (*rows[1:], full.shape[0])
    shards = [
        Shard(
            full[a:b].clone(),
            ShardMetadata(
                [a, *(0 for _ in full.shape[1:])], [b - a, *full.shape[1:]], "rank:0/cpu"
            ),
        )
        for a, b in zip(rows, stops)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor is deprecated
        return init_from_local_shards(shards, list(full.shape))


def _local_rows(st) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([s.tensor for s in st.local_shards()])


def test_sharded_tensor_state_round_trip_in_one_process(tmp_path, world_of_one):
    """FSDP1's ``ShardedTensor`` leaves: each local shard stored as a piece (here two in one
    process), loaded whole and into another ``ShardedTensor`` bit-exactly."""
    w = torch.randn(6, 4)
    state = {"w": _sharded_tensor(w, (0, 2)), "m": _sharded_tensor(w.double() * 3, (0, 3))}
    with CheckpointStore(tmp_path, chunk_size=32) as store:
        store.save(state, 1).wait()
        pieces = store.manifest(1).tensors[0].pieces
        assert [(p.offsets, p.sizes) for p in pieces] == [((0, 0), (2, 4)), ((2, 0), (4, 4))]
        loaded = store.load(1)
        assert torch.equal(loaded["w"], w) and torch.equal(loaded["m"], w.double() * 3)
        live = {"w": _sharded_tensor(torch.zeros(6, 4), (0, 3))}  # another layout
        store.load(1, keys="w", into=live)
        assert torch.equal(_local_rows(live["w"]), w)


def test_compact_keeps_the_pieces_and_the_next_save_writes_deltas(tmp_path, world_of_one):
    """Compacting a sharded checkpoint rewrites every piece as a full base with the same box:
    it loads bit-exactly, and a job that resumes from it writes XOR deltas of its pieces against
    the rewritten ones (their keys still match)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=g)
    options = {"chunk_size": 256, "max_chain_ratio": 100.0}
    with CheckpointStore(tmp_path, **options) as store:
        for step in range(1, 4):
            w = w + 1e-4 * torch.randn(w.shape, generator=g)
            store.save({"w": _sharded_tensor(w, (0, 24)), "n": step}, step).wait()
        before = store.manifest(3)
        assert any(r.depth for r in before.chunks.values()), "needs delta chains"
        assert store.compact() is not None
        after = store.manifest(3)
    assert not any(r.depth for r in after.chunks.values())
    boxes = [(p.offsets, p.sizes) for p in after.tensors[0].pieces]
    assert boxes == [(p.offsets, p.sizes) for p in before.tensors[0].pieces]
    assert boxes == [((0, 0), (24, 16)), ((24, 0), (40, 16))]
    with CheckpointStore(tmp_path, **options) as store:  # a new run resumes
        live = {"w": _sharded_tensor(torch.zeros(64, 16), (0, 24)), "n": 0}
        store.load(into=live)
        assert torch.equal(_local_rows(live["w"]), w)
        w = w + 1e-4 * torch.randn(w.shape, generator=g)
        result = store.save({"w": _sharded_tensor(w, (0, 24)), "n": 4}, 4).wait()
        assert result.chunks_delta == result.chunks_total > 0
        assert torch.equal(store.load(4)["w"], w)


def test_compact_refuses_a_store_opened_for_a_distributed_job(tmp_path, world_of_one):
    with CheckpointStore(tmp_path, distributed=True) as store:
        store.save({"w": _dtensor(torch.randn(4, 3))}, 1).wait()
        with pytest.raises(ConfigError, match="one process"):
            store.compact()
