"""Chunk codecs: a registry of encodings (see :mod:`.registry`), the built-in byte-grouped zstd
codecs, and the choice between them. Importing this package registers the built-ins."""

from lightning_incremental.core.codecs import zstd
from lightning_incremental.core.codecs.bytes import (
    HASH_LEN,
    chunk_hash,
    group_bytes,
    group_width,
    ungroup_bytes,
)
from lightning_incremental.core.codecs.choose import encode_best
from lightning_incremental.core.codecs.registry import (
    Codec,
    automatic,
    decode,
    get,
    kinds,
    register,
    unregister,
)

STANDALONE = zstd.STANDALONE
XOR = zstd.XOR

__all__ = [
    "HASH_LEN",
    "STANDALONE",
    "XOR",
    "Codec",
    "automatic",
    "chunk_hash",
    "decode",
    "encode_best",
    "get",
    "group_bytes",
    "group_width",
    "kinds",
    "register",
    "ungroup_bytes",
    "unregister",
]
