"""Many ranks, simulated: what the coordinator, a resharded load and retention cost against the
number of ranks of a sharded save, on the real code paths, in one process.

    python -m benchmarks.suites.scale.ranks [--ranks 16,256,4096] [--tensors 8]

No process group is started: each of N simulated ranks has written its part (one pack of
stored, verifiable chunks, a piece of every tensor: each tensor is split by rows over every
rank) and reports a :class:`~lightning_incremental.core.commit.sharded.PartRecord`, as it would
to the coordinator. On a local store, per N:

* **commit at rank 0**: what the coordinator does with the gathered records: merge them into
  one tensor table (:func:`~lightning_incremental.core.commit.sharded.merge`), then assemble,
  validate (every tensor's pieces must tile it) and write the manifest
  (:meth:`~lightning_incremental.core.commit.committer.Committer.commit`, which first checks
  every object a part wrote is present). Also the records' pickled bytes (what the gather
  carries) and the manifest's bytes;
* **resharded load plan**: :func:`~lightning_incremental.core.load.scatter.piece_targets` for
  every tensor, loaded on N/2 ranks (each wanted box meets two stored pieces), with the box
  tests it took;
* **retention**: a dry-run ``gc(keep_last=1)`` over the checkpoints committed so far (three:
  the lease's tiny first one and two of N parts), which reads and verifies the kept manifest
  (every pack hashed) and lists the packs to find the ones no kept checkpoint names.

Each phase is timed with ``time.perf_counter``: the plan best of ``repeats``, the merge (which
is pure) best of at least three, the commit and the ``gc`` plan once (the second step's commit
is kept). Records are those of :func:`benchmarks.suites.scale.figures.record` (``sweep``
``"ranks"``, ``size`` the ranks, ``unit`` ``"s"``) with the counts as extra keys.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pickle
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core import CheckpointStore, codecs
from lightning_incremental.core.chunks.encode import Encoded
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.commit.committer import Part
from lightning_incremental.core.commit.sharded import PartRecord, merge
from lightning_incremental.core.format import boxindex, pieces
from lightning_incremental.core.format.layout import audit_record, pack_path
from lightning_incremental.core.format.pieces import Box
from lightning_incremental.core.format.records import ChunkRecipe, TensorEntry
from lightning_incremental.core.format.tree import ShardedInfo
from lightning_incremental.core.load import scatter
from lightning_incremental.core.load.targets import Regions
from lightning_incremental.core.save.snapshot import flatten_state

ROWS = 4  # rows of each tensor per rank
COLS = 8  # float32 columns: a piece of 128 bytes, one chunk


def _row(case: str, ranks: int, figure: str, seconds: float, **extra: Any) -> dict[str, Any]:
    return {
        "sweep": "ranks",
        "case": case,
        "size": ranks,
        "ranks": ranks,
        "figure": figure,
        "ours": seconds,
        "baseline": None,
        "baseline_name": None,
        "unit": "s",
        "ratio": None,
        "target": None,
        "target_absolute": False,
        "met": None,
        "detail": None,
        **extra,
    }


@contextlib.contextmanager
def _box_tests() -> Iterator[list[int]]:
    """Counts the box tests made inside: calls of ``intersect`` and of the box index's
    ``meets`` (the primitives of a load plan), in ``counted[0]``."""
    counted = [0]
    patched = [(pieces, "intersect"), (scatter, "intersect"), (boxindex, "meets")]
    originals = [getattr(module, name) for module, name in patched]

    def wrap(inner: Any) -> Any:
        def call(*args: Any) -> Any:
            counted[0] += 1
            return inner(*args)

        return call

    for (module, name), inner in zip(patched, originals):
        setattr(module, name, wrap(inner))
    try:
        yield counted
    finally:
        for (module, name), inner in zip(patched, originals):
            setattr(module, name, inner)


def _records(store: CheckpointStore, step: int, ranks: int, flat: Any) -> list[PartRecord]:
    """The records N ranks send after each wrote its part of ``step`` (its pack is written
    here, as the rank would have)."""
    shape = (ranks * ROWS, COLS)
    sharded = {
        leaf.slot: ShardedInfo(leaf.path, "float32", shape, "cpu", 4, True, True)
        for leaf in flat.leaves
    }
    size = ROWS * COLS * 4
    stored = codecs.get("s")
    records = []
    for rank in range(ranks):
        entries, recipes, payloads = [], {}, []
        at = 0
        for slot in sharded:
            values = torch.full((ROWS, COLS), float(step), dtype=torch.float32)
            values[0, :3] = torch.tensor([rank, slot, step], dtype=torch.float32)
            raw = values.reshape(-1).view(torch.uint8).numpy()
            digest = chunk_hash(raw)
            payload = bytes(stored.encode(raw, None, width=4, level=0) or b"")
            recipes[digest] = ChunkRecipe("s", "", at, len(payload), size, 4, chain=len(payload))
            payloads.append(payload)
            at += len(payload)
            entries.append(
                TensorEntry(
                    sharded[slot].path,
                    "float32",
                    (ROWS, COLS),
                    size,
                    4,
                    "cpu",
                    False,
                    True,
                    True,
                    (digest,),
                )
            )
        data = b"".join(payloads)
        pack = pack_path(chunk_hash(data))  # a pack is named by its content, as packs.py does
        recipes = {d: dataclasses.replace(r, pack=pack) for d, r in recipes.items()}
        nbytes = len(data)
        store.storage.put(pack, data)
        encoded = Encoded([], {}, {}, bytes_written=nbytes, chunks_total=len(sharded))
        part = Part(
            step, None, 0, tuple(entries), recipes, {pack: nbytes}, frozenset({pack}), encoded
        )
        arrays = tuple((slot, (rank * ROWS, 0)) for slot in sharded)
        records.append(PartRecord(rank, step, flat.slots, part, arrays, sharded))
    return records


def one(ranks: int, tensors: int, repeats: int, root: Path) -> list[dict[str, Any]]:
    """The rows of one rank count."""
    directory = Path(tempfile.mkdtemp(prefix=f"ranks-{ranks}-", dir=root))
    store = CheckpointStore(str(directory), min_object_age_s=0.0)
    try:
        store.save({"lease": torch.zeros(1)}, step=0)  # takes the writer lease, as a save does
        flat = flatten_state({"model": {f"layer{i}": torch.zeros(1) for i in range(tensors)}})
        case = f"{ranks:,} ranks, {tensors} tensors"
        committer = store._committer  # the coordinator's committer, as commit_sharded uses it
        audit = audit_record(None, ranks)
        for step in (1, 2):
            records = _records(store, step, ranks, flat)
            gathered = len(pickle.dumps(records))
            merge_s = float("inf")
            for _ in range(max(3, repeats)):  # the merge is pure: best of a few
                began = time.perf_counter()
                table = merge(records)
                merged = time.perf_counter()
                merge_s = min(merge_s, merged - began)
            committed = committer.commit(
                step,
                [r.part for r in records if r.part is not None],
                generation=store.generation,
                audit=audit,
                tree=flat.skeleton,
                tensors=table,
            )
            done = time.perf_counter()
        rows = [
            _row(case, ranks, "commit at rank 0: merge the parts", merge_s,
                 gathered_bytes=gathered),
            _row(case, ranks, "commit at rank 0: validate and write the manifest", done - merged,
                 manifest_bytes=committed.nbytes, pieces=ranks * tensors),
        ]  # fmt: skip
        manifest = committed.manifest
        wanted_ranks = max(1, ranks // 2)
        span = ranks * ROWS // wanted_ranks
        boxes = [Box((i * span, 0), (span, COLS)) for i in range(wanted_ranks)]
        outs = [torch.empty(manifest.tensors[0].shape) for _ in manifest.tensors]

        def plan() -> list[Any]:
            return [
                scatter.piece_targets(
                    entry,
                    Regions(tuple((out[box.slices()], box) for box in boxes)),
                    manifest.chunks,
                )
                for entry, out in zip(manifest.tensors, outs)
            ]

        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            plan()
            best = min(best, time.perf_counter() - began)
        with _box_tests() as counted:  # once more, counted (not timed: counting costs)
            reads = sum(len(targets) for targets in plan())
        tests = counted[0]
        rows.append(
            _row(case, ranks, "resharded load plan, onto half the ranks", best,
                 box_tests=tests, pieces_read=reads, loaded_on=wanted_ranks)
        )  # fmt: skip
        began = time.perf_counter()
        report = store.gc(keep_last=1, dry_run=True)
        rows.append(
            _row(case, ranks, "retention: gc plan (dry run)", time.perf_counter() - began,
                 removed_steps=len(report.removed_steps),
                 removed_objects=len(report.removed_objects))
        )  # fmt: skip
        return rows
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)


def run(
    ranks: tuple[int, ...] = (16, 256, 4096),
    tensors: int = 8,
    repeats: int = 1,
    root: str | None = None,
) -> list[dict[str, Any]]:
    """The records of every rank count in ``ranks`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="scale-ranks-", dir=root) as tmp:
        return [row for n in ranks for row in one(n, tensors, repeats, Path(tmp))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suites.scale.ranks", description=__doc__)
    p.add_argument("--ranks", default="16,256,4096", help="simulated ranks, e.g. 16,256,4096")
    p.add_argument("--tensors", type=int, default=8, help="tensors, each split over every rank")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    ranks = tuple(int(v) for v in args.ranks.split(",") if v.strip())
    for row in run(ranks, args.tensors, args.repeats):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
