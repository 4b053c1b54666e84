"""Chunk codecs: a registry of encodings (see :mod:`.registry`), the built-in lossless codecs
(byte planes; byte-grouped zstd for earlier checkpoints), the opt-in lossy codecs for optimizer
state, and the choice between them. Importing this package registers the built-ins."""

from lightning_incremental.core.codecs import lossy, planes, stored, zstd
from lightning_incremental.core.codecs.bytes import (
    HASH_LEN,
    chunk_hash,
    group_bytes,
    group_width,
    ungroup_bytes,
)
from lightning_incremental.core.codecs.choose import Hint, encode_best, encode_choice
from lightning_incremental.core.codecs.registry import (
    Codec,
    automatic,
    decode,
    delta_of,
    get,
    kinds,
    register,
    unregister,
)

STANDALONE = zstd.STANDALONE
XOR = zstd.XOR
PLANES = planes.PLANES
PLANES_DELTA = planes.PLANES_DELTA
INT8 = lossy.INT8
LOG8 = lossy.LOG8
BF16 = lossy.BF16
LOG8_DELTA = lossy.LOG8_DELTA
BF16_DELTA = lossy.BF16_DELTA
STORED = stored.STORED

__all__ = [
    "BF16",
    "BF16_DELTA",
    "HASH_LEN",
    "INT8",
    "LOG8",
    "LOG8_DELTA",
    "PLANES",
    "PLANES_DELTA",
    "STANDALONE",
    "STORED",
    "XOR",
    "Codec",
    "Hint",
    "automatic",
    "chunk_hash",
    "decode",
    "delta_of",
    "encode_best",
    "encode_choice",
    "get",
    "group_bytes",
    "group_width",
    "kinds",
    "register",
    "ungroup_bytes",
    "unregister",
]
