"""Which chunks are coded lossily, and how they are keyed so that a lossless tensor never shares
a lossy chunk: the configured lossy codec of a tensor, the lossy key, and the checks that a
reused or adopted chunk is encoded the way its tensor is now."""

from __future__ import annotations

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import Codec, chunk_hash
from lightning_incremental.core.codecs.optimizer_state import codec_kind
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format.records import ChunkRecipe


def lossy_codec(path: str, config: StoreConfig, dtype: str = "float32") -> Codec | None:
    """The lossy codec for the tensor at key path ``path``: the one ``config.lossy_codecs``
    names (the longest matching prefix), else the one ``config.optimizer_state`` gives an
    optimizer moment of dtype float32; None for lossless encoding."""
    if config.lossy_codecs:
        matches = [p for p in config.lossy_codecs if path == p or path.startswith(p)]
        if matches:
            return codecs.get(config.lossy_codecs[max(matches, key=len)])
    kind = codec_kind(path, config.optimizer_state) if dtype == "float32" else None
    return codecs.get(kind) if kind else None


def family(lossy: Codec) -> set[str]:
    """The kinds of a lossy codec's chunks: its own and its delta codec's."""
    delta = codecs.delta_of(lossy)
    return {lossy.kind} | ({delta.kind} if delta else set())


def lossy_key(digest: str, kind: str) -> str:
    """The key of a chunk of raw hash ``digest`` coded by the lossy codec ``kind`` (the
    standalone kind the tensor is configured with; its delta codec's chunks share the key).

    Chunks are deduplicated by key, within a save and against the parent's chunks. Keyed by its
    raw hash, a lossy chunk would stand for every chunk of the same bytes: a lossless tensor
    sharing them (a weight equal to its average, a zero buffer equal to a zero moment) would
    restore the lossy bytes. A key of its own — the chunk hash of the kind and the raw hash, 32
    hex digits like any other key — keeps a lossless and a lossy chunk of the same bytes apart,
    and lossy tensors of the same code still share chunks. It is reproducible, so the next save
    finds an unchanged lossy chunk in its parent. Restore checks a lossy chunk against the hash
    of its decoded bytes (``ChunkRecipe.decoded``), never against its key: checkpoints written
    when lossy chunks were keyed by their raw hash load all the same."""
    return chunk_hash(f"lossy:{kind}:{digest}".encode())


def reusable(known: ChunkRecipe, lossy: Codec | None, full_base: bool) -> bool:
    """Whether a parent's chunk of the same key may be referenced as it is: encoded the way this
    tensor is now (lossless, or by the same lossy code), and no delta in a full base."""
    same = known.lossless if lossy is None else known.kind in family(lossy)
    return same and (not full_base or known.depth == 0)
