"""Export a checkpoint as a standard ``torch.distributed.checkpoint`` (DCP) directory, without
ever holding a whole sharded tensor.

Every stored piece becomes one DCP chunk of its global tensor (``ChunkStorageMetadata(offsets,
sizes)``), exactly as if the rank that held it had called ``dcp.save``: DCP's loaders reshard
from there (``dcp.load`` onto any mesh, ``format_utils.dcp_to_torch_save``). A non-sharded
tensor is one chunk, the whole of it. A piece is decoded from the store only when DCP's writer
asks for its data, one at a time: peak memory is one piece.

How: the leaves of the state handed to ``dcp.save`` are :class:`StoredTensor` objects, which
implement DCP's own extension hook ``__create_write_items__`` (one ``SHARD`` write item per
piece; DTensor uses the same hook), and :class:`PiecesSavePlanner`'s ``lookup_object`` hands out
a piece's data by its offsets. Plain values are written as DCP writes them (pickled ``BYTE_IO``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.errors import PickleNotAllowedError
from lightning_incremental.core.format.pieces import Box
from lightning_incremental.core.format.records import Manifest, TensorEntry
from lightning_incremental.core.format.tree import torch_dtype, unflatten
from lightning_incremental.core.load.pipeline import restore_chunks
from lightning_incremental.core.load.restore import prune
from lightning_incremental.core.load.targets import ChunkTarget
from lightning_incremental.core.storage import Storage


class StoredTensor:
    """A global tensor known by its stored pieces; ``read(i)`` decodes piece ``i``."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        pieces: list[Box],
        read: Callable[[int], torch.Tensor],
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces = pieces
        self.read = read
        self.by_offsets = {tuple(b.offsets): i for i, b in enumerate(pieces)}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)
                    ),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for box in self.pieces
        ]

    def piece(self, offsets: Any) -> torch.Tensor:
        return self.read(self.by_offsets[tuple(offsets)])


def _planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class PiecesSavePlanner(DefaultSavePlanner):
        """The default planner (flattening, global plan validation), reading pieces lazily."""

        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict[index.fqn]
            if isinstance(obj, StoredTensor):
                return obj.piece(index.offset)
            return super().lookup_object(index)

    return PiecesSavePlanner()


def _leaf(
    storage: Storage, doc: Manifest, entry: TensorEntry, pool: ThreadPoolExecutor, where: str
) -> Any:
    """What the exported state holds for a tensor entry: a :class:`StoredTensor`, or for a
    numpy array the array itself (DCP pickles it)."""

    def decode(chunks: tuple[str, ...], nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes, dtype=np.uint8)
        restore_chunks(storage, doc, pool, where, [ChunkTarget(chunks, raw)])
        return raw

    if entry.numpy:
        return decode(entry.chunks, entry.nbytes).view(np.dtype(entry.dtype)).reshape(entry.shape)
    dtype = torch_dtype(entry.dtype)
    stored = entry.stored_pieces()
    if not stored:  # an empty sharded tensor: one empty chunk, as DCP writes it
        stored = [(Box(tuple(0 for _ in entry.shape), entry.shape), ())]

    def read(index: int) -> torch.Tensor:
        box, chunks = stored[index]
        raw = decode(chunks, box.numel * dtype.itemsize)
        return torch.from_numpy(raw).view(dtype).reshape(box.sizes)

    return StoredTensor(entry.shape, dtype, [box for box, _ in stored], read)


def export_dcp(
    storage: Storage,
    doc: Manifest,
    to: str | os.PathLike[str],
    *,
    keys: tuple[str, ...] | None = None,
    allow_pickle: bool = False,
    workers: int = 2,
) -> int:
    """Write checkpoint ``doc`` of ``storage`` as a DCP checkpoint in directory ``to`` (top-level
    ``keys`` only, when given); returns the bytes written (the files it wrote, not what ``to``
    held before). Needs no process group.

    Raises:
        ConfigError: a key of ``keys`` the checkpoint lacks.
        PickleNotAllowedError: the checkpoint holds pickles and ``allow_pickle`` is off.
        CorruptCheckpointError: an object fails its checks.
    """
    import torch.distributed.checkpoint as dcp

    where = f"step {doc.step} of {storage.url}"
    if doc.pickled and not allow_pickle:
        raise PickleNotAllowedError(
            f"checkpoint {where} holds pickled objects at {', '.join(doc.pickled[:5])}; "
            "exporting them executes code — pass allow_pickle only if you trust it"
        )
    skeleton, wanted = prune(doc.tree, keys, where)
    out = Path(to)
    before = _files(out)
    with ThreadPoolExecutor(workers, thread_name_prefix="li-export") as pool:
        values = [
            _leaf(storage, doc, entry, pool, where) if wanted is None or i in wanted else None
            for i, entry in enumerate(doc.tensors)
        ]
        state = unflatten(skeleton, values, allow_pickle=allow_pickle)
        writer = dcp.FileSystemWriter(out, thread_count=1, single_file_per_rank=True)
        dcp.save(state, storage_writer=writer, planner=_planner(), no_dist=True)
    # What this export wrote: the files that are new or were rewritten, not what the directory
    # held before (another checkpoint, or anything else).
    return sum(st.st_size for name, st in _files(out).items() if _rewritten(before.get(name), st))


def _files(directory: Path) -> dict[Path, os.stat_result]:
    """Every file under ``directory`` (none when it does not exist), with its status."""
    return {f: f.stat() for f in directory.rglob("*") if f.is_file()} if directory.is_dir() else {}


def _rewritten(before: os.stat_result | None, after: os.stat_result) -> bool:
    return before is None or (before.st_ino, before.st_mtime_ns, before.st_size) != (
        after.st_ino,
        after.st_mtime_ns,
        after.st_size,
    )
