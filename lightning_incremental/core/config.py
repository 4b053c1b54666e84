"""Store configuration: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs.optimizer_state import POLICIES
from lightning_incremental.core.errors import ConfigError
from lightning_incremental.core.workers import BACKGROUND_NICE

MiB = 1 << 20
EFFORTS = ("auto", "full", "fast")
MAX_CHUNK_SIZE = 1 << 30  # manifests naming larger chunks are rejected (manifest.py)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How a :class:`~lightning_incremental.core.CheckpointStore` encodes and writes checkpoints.

    Attributes:
        chunk_size: bytes per chunk of a tensor's raw data (a multiple of 16). Chunks are the unit
            of deduplication and of delta encoding: smaller chunks find more unchanged data in
            sparse updates, larger ones cost less manifest and hashing overhead. Default 4 MiB.
        full_every: every ``full_every``-th checkpoint is a full base: no chunk of it depends on a
            delta. ``1`` disables delta chains entirely. Default 10.
        max_chain: the longest chain of XOR deltas one chunk may depend on; a chunk whose chain
            would grow past it is stored standalone. Bounds restore work. Default 8.
        max_chain_ratio: a chunk's chain (its base plus deltas) may store at most this many times
            the chunk's raw size; past it the chunk is stored standalone. Bounds restore reads for
            dense updates, where every delta is large. A chunk with room for one delta only (dense
            fp32 weights) is then coded against its standalone root at every save, while that
            delta stays well under the root's size, rather than alternating delta and standalone
            copies: fewer bytes, and every restore of it reads root + one delta. Default 2.0.
        compression_level: zstd level, -7..22. 1 is fast and already captures most of what the
            byte-grouped planes give. Default 1.
        xor_delta: encode changed chunks as XOR against the previous checkpoint when smaller.
            Needs the previous snapshot in host memory (see ``xor_base_memory``). Default True.
        xor_base_memory: most bytes of the previous snapshot kept in host memory as XOR base;
            ``None`` keeps all of it (host memory equal to the checkpoint's tensor bytes), ``0``
            is the same as ``xor_delta=False``. Tensors past the budget are stored standalone
            when they change, unless ``xor_base_from_storage``. Default None.
        xor_base_from_storage: when the previous checkpoint's bytes are not in memory (the
            first save after a restart or a restore, tensors past ``xor_base_memory``), decode
            each changed chunk's base from storage, chunk by chunk, in the background: the save
            reads the previous checkpoint's objects once, and writes deltas instead of
            standalone chunks. A restore then never keeps a second copy of the state for the next
            save. Default True.
        keep_last: after each commit, delete checkpoints older than the newest ``keep_last``
            (never an object that a kept checkpoint still needs, never the newest intact
            checkpoint). ``None`` keeps all. It also caps ``full_every`` (a full base at least
            every ``keep_last`` checkpoints), so that disk use stays about ``keep_last``
            checkpoints: the price is a full base more often. Default None.
        max_in_flight: saves that may be queued or running in the background; ``save`` blocks
            (back-pressure) while this many are pending. Each holds one snapshot of the state in
            host memory. Default 1.
        workers: threads that encode and compress in the background, and decode on restore
            (zstd and numpy release the GIL). Packs are written by two threads of their own, so
            that a write blocked in fsync leaves no core idle; with ``workers=1`` the one worker
            writes them too (one background thread, every storage call in order). Default None:
            the cores training leaves free (:func:`~lightning_incremental.core.workers.free_cores`:
            the cores this process may use less ``torch.get_num_threads()``, or less one under
            CUDA), at least 1 and at most 4, with the two writers; a restore, which its caller
            waits for, decodes on every core the process may use, at most 8
            (:func:`~lightning_incremental.core.workers.restore_cores`). A number given here
            bounds both.
        background_nice: how far below the training's the scheduling priority of the store's
            background threads (saving, encoding, writing) is, 0..19, on Linux (elsewhere they
            run at the normal priority). Under contention training keeps the cores and a save
            runs in the gaps: a save takes longer to become durable, training loses less. 0:
            the same priority as training. Default 10.
        codec_effort: how much CPU a save spends to write fewer bytes. ``"full"``: every changed
            chunk raced over the codecs (predicted deltas, byte planes, zstd). ``"fast"``: changed
            chunks stored as they are (codec ``s``: no CPU beyond the copy; unchanged chunks are
            still referenced, not written). ``"auto"`` (default): fast while the last save's
            background thread waited longer for a CPU than it ran (training holds every core, and
            the codec's CPU would come out of training's), or while saves are asked for before a
            save coded in full has ended (they would queue up and training wait for them)
            (:mod:`~lightning_incremental.core.commit.effort`); otherwise paced: a changed chunk the
            codec shrinks little (dense float32 noise) is coded in full only while its coding ends
            before the writers run out of work, else stored as it is
            (:mod:`~lightning_incremental.core.chunks.pace`: every chunk is coded where storage is
            slower than the codec; a save on a disk faster than the codec is durable about when its
            raw bytes would be). Opt-in lossy codecs (``optimizer_state``) always apply.
        pack_size: encoded chunks are appended to pack objects of about this size, so a save of
            thousands of small tensors writes a few objects, not thousands. Packs are written while
            later chunks are still being encoded: smaller packs overlap more and hold less in
            memory, larger ones make fewer objects (requests, on object stores). The packs of
            the last quarter of a save are cut down to 2 MiB, so that little is left to write
            once the last chunk is encoded. Default 16 MiB.
        fsync: fsync data objects and manifests on local disks before a checkpoint is reported
            committed. Turn off only for scratch stores. Default True.
        allow_pickle: save values the JSON skeleton cannot express by pickling them, and accept
            loading checkpoints that hold pickles. Loading a pickle executes code: only for
            checkpoints you trust. Default False.
        lease_ttl_s: the writer lease (see :mod:`~lightning_incremental.core.commit.lease`) is
            renewed every ``lease_ttl_s / 4`` seconds and counts as abandoned when not renewed for
            ``lease_ttl_s``: how long a writer that died on another host blocks a new one
            (on the same host a dead writer's lease is taken over at once). Default 60.
        min_object_age_s: no sweep (``gc``, ``delete``, retention after a commit) removes an
            object younger than this, by the storage's own clock, whatever its grace period: a
            save in flight may be about to name it (another rank's part, a writer on another
            host, the new generation of a restarted job while an old one's late sweep runs).
            It must exceed the longest save, uploads included (S3 dates a multipart upload by
            its start). The price: objects of removed checkpoints younger than this stay until
            a later sweep. ``0`` only for a store no other process writes to. Default 900.
        lossy_codecs: opt-in lossy encoding per key: ``{key path prefix: codec kind}``, e.g.
            ``{"state['optimizer']": "<kind>"}``; a tensor whose key path (as the manifest
            records it) starts with a prefix is encoded by that registered lossy codec (the
            longest prefix wins). Its chunks are labelled lossy in the manifest and verified
            against the hash of their decoded bytes; it does not restore bit-exact. Default
            None: everything is lossless.
        optimizer_state: how optimizer moments are stored (see
            :mod:`~lightning_incremental.core.codecs.optimizer_state`): ``"exact"`` (lossless, the
            default), ``"bf16"`` or ``"int8"`` (int8 blocks for ``exp_avg``, 8-bit log blocks for
            ``exp_avg_sq``; about 4x fewer bytes for them). Lossy settings restore those tensors
            approximately, not bit-exact: labelled in the manifest, reported on load. Keys named
            in ``lossy_codecs`` take precedence.
        generation: the writer's fencing generation, recorded in every manifest (see
            :mod:`~lightning_incremental.core.commit.fencing`). Default None: the newest generation
            claimed in the store (0 when none was), taken at the first save;
            :meth:`CheckpointStore.claim_generation` claims a new one.
    """

    chunk_size: int = 4 * MiB
    full_every: int = 10
    max_chain: int = 8
    max_chain_ratio: float = 2.0
    compression_level: int = 1
    xor_delta: bool = True
    xor_base_memory: int | None = None
    xor_base_from_storage: bool = True
    keep_last: int | None = None
    max_in_flight: int = 1
    workers: int | None = None
    background_nice: int = BACKGROUND_NICE
    codec_effort: str = "auto"
    pack_size: int = 16 * MiB
    fsync: bool = True
    allow_pickle: bool = False
    generation: int | None = None
    lease_ttl_s: float = 60.0
    min_object_age_s: float = 900.0
    lossy_codecs: Mapping[str, str] | None = None
    optimizer_state: str = "exact"

    def __post_init__(self) -> None:
        _int("chunk_size", self.chunk_size, minimum=16)
        if self.chunk_size > MAX_CHUNK_SIZE:
            raise ConfigError(f"chunk_size must be <= 1 GiB, got {self.chunk_size}")
        if self.chunk_size % 16:
            raise ConfigError(f"chunk_size must be a multiple of 16 bytes, got {self.chunk_size}")
        _int("full_every", self.full_every, minimum=1)
        _int("max_chain", self.max_chain, minimum=0)
        if isinstance(self.max_chain_ratio, bool) or not isinstance(
            self.max_chain_ratio, (int, float)
        ):
            raise ConfigError(f"max_chain_ratio must be a number, got {self.max_chain_ratio!r}")
        if not self.max_chain_ratio >= 1.0:
            raise ConfigError(f"max_chain_ratio must be >= 1.0, got {self.max_chain_ratio!r}")
        _int("compression_level", self.compression_level, minimum=-7)
        if self.compression_level > 22 or self.compression_level == 0:
            raise ConfigError(
                f"compression_level must be in -7..-1 or 1..22, got {self.compression_level}"
            )
        _bool("xor_delta", self.xor_delta)
        if self.xor_base_memory is not None:
            _int("xor_base_memory", self.xor_base_memory, minimum=0)
        if self.keep_last is not None:
            _int("keep_last", self.keep_last, minimum=1)
        _int("max_in_flight", self.max_in_flight, minimum=1)
        if self.workers is not None:
            _int("workers", self.workers, minimum=1)
        _int("background_nice", self.background_nice, minimum=0)
        if self.codec_effort not in EFFORTS:
            raise ConfigError(
                f"codec_effort must be one of {', '.join(EFFORTS)}, got {self.codec_effort!r}"
            )
        if self.background_nice > 19:
            raise ConfigError(f"background_nice must be in 0..19, got {self.background_nice}")
        _int("pack_size", self.pack_size, minimum=1)
        _bool("xor_base_from_storage", self.xor_base_from_storage)
        _bool("fsync", self.fsync)
        _bool("allow_pickle", self.allow_pickle)
        if self.generation is not None:
            _int("generation", self.generation, minimum=0)
        if (
            isinstance(self.lease_ttl_s, bool)
            or not isinstance(self.lease_ttl_s, (int, float))
            or not self.lease_ttl_s > 0
        ):
            raise ConfigError(f"lease_ttl_s must be a number > 0, got {self.lease_ttl_s!r}")
        if (
            isinstance(self.min_object_age_s, bool)
            or not isinstance(self.min_object_age_s, (int, float))
            or not self.min_object_age_s >= 0
        ):
            raise ConfigError(
                f"min_object_age_s must be a number >= 0, got {self.min_object_age_s!r}"
            )
        if self.lossy_codecs is not None:
            _lossy_codecs(self.lossy_codecs)
        if self.optimizer_state not in POLICIES:
            raise ConfigError(
                f"optimizer_state must be one of {', '.join(map(repr, POLICIES))}, got "
                f"{self.optimizer_state!r}"
            )

    @property
    def base_every(self) -> int:
        """How often a full base is written: ``full_every``, or ``keep_last`` when smaller. A kept
        delta needs every object of its chain back to its base, so with longer chains than
        ``keep_last`` retention would keep deleted checkpoints' objects alive and disk use would
        grow to ``full_every`` checkpoints instead of about ``keep_last``."""
        if self.keep_last is None:
            return self.full_every
        return min(self.full_every, self.keep_last)

    @property
    def uses_xor(self) -> bool:
        return self.xor_delta and self.base_every > 1 and self.xor_base_memory != 0

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes`` applied (validated)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(
                f"unknown store option(s) {sorted(unknown)}; valid: "
                f"{sorted(f.name for f in dataclasses.fields(self))}"
            )
        return dataclasses.replace(self, **changes)


def _int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _lossy_codecs(value: object) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"lossy_codecs must be a dict of key path prefix -> codec kind, got {value!r}"
        )
    for prefix, kind in value.items():
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"lossy_codecs: key path prefix {prefix!r} is not a non-empty str")
        try:
            codec = codecs.get(kind)
        except ValueError as exc:
            raise ConfigError(f"lossy_codecs[{prefix!r}]: {exc}") from exc
        if codec.lossless:
            raise ConfigError(
                f"lossy_codecs[{prefix!r}]: codec {kind!r} is lossless; name a lossy codec "
                "(lossless ones are chosen automatically)"
            )
        if codec.needs_base:
            raise ConfigError(
                f"lossy_codecs[{prefix!r}]: codec {kind!r} is a delta; name its standalone "
                f"codec {codec.standalone!r} (its deltas are chosen automatically)"
            )
