"""Replica consistency: detect (and optionally repair) data-parallel ranks whose state diverged.

Data-parallel replicas must hold bit-identical parameters, buffers and optimizer state. A rank
can diverge silently — a bit flip in memory, a zombie rank that kept computing alone, a
nondeterministic kernel — and a checkpoint written from the coordinator then hides the problem
until the run is resumed on a different rank layout. So at checkpoint time every rank
fingerprints its replicated state (one 128-bit hash per value, cheap next to serialising it), the
fingerprints are gathered, and a per-value majority vote names each rank that differs and the
values in which it differs.

Pure functions do the work and are testable without processes: ``fingerprint`` (state -> hashes),
``compare`` (hashes of every rank -> ``ReplicaReport``). Thin helpers talk to
``torch.distributed``: ``gather_fingerprints``, ``broadcast_state_`` and ``check_replicas``
(fingerprint + gather + compare, the same report on every rank) and ``repair_`` (broadcast the
reference copy in place).

Only pass *replicated* state (model ``state_dict`` and optimizer ``state_dict`` under data
parallelism): per-rank values such as RNG states, sampler positions or FSDP/DTensor shards
legitimately differ between ranks and would be reported.

What a caller does with a divergence is policy (warn, repair, or stop: see
:mod:`lightning_incremental.runtime.policy.replica_policy`). ``EXIT_REPLICA_DIVERGED`` (89) is the
distinct process exit code for the ``stop`` action, so that a supervisor can tell "a replica
diverged" from a crash or an ordinary failure and, e.g., restart from the last verified
checkpoint instead of retrying blindly.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from lightning_incremental.core.errors import CheckpointError
from lightning_incremental.runtime.cluster import collectives

log = logging.getLogger("lightning_incremental")

EXIT_REPLICA_DIVERGED = 89
"""Process exit code of the ``stop`` action on a replica divergence (distinct from 1, signals)."""

SEP = "/"
VALUE_PREFIX = "="
"""Fingerprints of non-tensor values start with this; tensor fingerprints with their dtype."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size)


class ReplicaDivergedError(CheckpointError, RuntimeError):
    """Replicas hold different state (and, when raised by ``repair_``, a broadcast cannot fix it:
    keys missing on some ranks, different dtypes or shapes, or differing non-tensor values)."""

    def __init__(self, report: ReplicaReport, message: str | None = None) -> None:
        super().__init__(message or report.describe())
        self.report = report


# ---------------------------------------------------------------- walking and hashing


def _segment(key: Any) -> str:
    """One key-path segment. ``/`` and ``%`` in string keys are percent-escaped so that paths are
    unambiguous; ints (optimizer param ids, list indices) appear as digits."""
    if isinstance(key, str):
        return key.replace("%", "%25").replace(SEP, "%2F")
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return repr(key)


def leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(key path, leaf)`` for every tensor, numpy array and plain value of ``state``.

    Dicts, lists and tuples are walked in order (dict insertion order); sets are one leaf.
    Objects without a stable, data-only representation (modules, functions, devices — a device
    legitimately differs per rank) are skipped. A path seen twice (e.g. keys ``3`` and ``"3"`` in
    one dict) gets a ``#n`` suffix so that every path is unique.
    """
    seen: set[str] = set()
    for path, leaf in _walk(state, prefix):
        unique, n = path, 1
        while unique in seen:
            n += 1
            unique = f"{path}#{n}"
        seen.add(unique)
        yield unique, leaf


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}{SEP}{_segment(k)}" if path else _segment(k))
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}{SEP}{i}" if path else str(i))
    elif isinstance(value, (torch.Tensor, np.ndarray, np.generic, set, frozenset, *_PLAIN)):
        yield path, value


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (no copy) of a contiguous tensor's bytes, for any dtype. Hashing and
    broadcasting raw bytes is bit-exact (NaN payloads included) and sidesteps backends' dtype
    gaps (gloo and bool/bfloat16/complex)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a size-1 dim may keep any stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _tensor_fingerprint(t: torch.Tensor) -> str:
    """``"<dtype>[<shape>]:<xxh3-128 of the element bytes>"``; bitwise, so -0.0 != 0.0 and NaNs
    compare by payload, which is exactly what identical replicas satisfy."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    meta = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    if t.device.type == "meta":
        return f"{meta}:meta"
    t = t.resolve_conj().resolve_neg()  # no-ops unless the lazy bits are set
    if t.device.type != "cpu":
        t = t.cpu()  # one device-to-host copy per tensor; hashing on the device would avoid it
    t = t.contiguous()  # a view when already contiguous: no copy
    digest = xxhash.xxh3_128()
    if t.numel():
        digest.update(_raw(t).numpy().data)  # zero-copy
    return f"{meta}:{digest.hexdigest()}"


def _value_fingerprint(value: Any) -> str:
    """``"=<type>:<hash>"`` of a non-tensor leaf from a stable text: ``repr`` for plain values
    (exact for floats), raw bytes for numpy data, sorted member texts for sets."""
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(value)
        text = f"{array.dtype.str}{list(array.shape)}".encode() + array.view(np.uint8).tobytes()
    elif isinstance(value, (set, frozenset)):
        text = repr(sorted(repr(v) for v in value)).encode()
    else:
        text = repr(value).encode()
    return f"{VALUE_PREFIX}{type(value).__name__}:{xxhash.xxh3_128_hexdigest(text)}"


def fingerprint(state: Any, *, values: bool = True) -> dict[str, str]:
    """One fingerprint per leaf of ``state``, keyed by its key path (``"model/net.0.weight"``,
    ``"optimizers/0/state/3/exp_avg"``).

    Tensors hash their dtype, shape and raw element bytes (``xxh3_128`` over a uint8 view of the
    contiguous CPU data, so every dtype works and no Python loop touches elements); non-contiguous
    views hash like their contiguous copies. Device and ``requires_grad`` are not hashed: they are
    not the replica's data. With ``values`` (the default) plain values — ints, floats, strings,
    bools, None, numpy data — are hashed too, because e.g. an optimizer ``step`` count or a
    learning rate that differs is a divergence as real as a weight that does.

    The same tensor object reached twice (tied weights) is hashed once.
    """
    out: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for path, leaf in leaves(state):
        if isinstance(leaf, torch.Tensor):
            fp = by_id.get(id(leaf))
            if fp is None:
                fp = by_id[id(leaf)] = _tensor_fingerprint(leaf)
            out[path] = fp
        elif values:
            out[path] = _value_fingerprint(leaf)
    return out


def _is_tensor_fp(fp: str) -> bool:
    return not fp.startswith(VALUE_PREFIX)


def _meta(fp: str) -> str:
    return fp.rpartition(":")[0]


# ---------------------------------------------------------------- comparing


@dataclass(frozen=True)
class ReplicaReport:
    """The outcome of comparing every rank's fingerprints; identical on every rank.

    Ranks are indices into the gathered list, i.e. ranks within the process group.
    """

    world_size: int
    coordinator: int
    keys: tuple[str, ...]  # every key seen on any rank, in the coordinator's order then others'
    diverged: dict[int, list[str]]  # rank -> keys differing from the reference (incl. below)
    missing: dict[int, list[str]]  # rank -> reference keys the rank lacks
    extra: dict[int, list[str]]  # rank -> keys the rank holds but the reference lacks
    source: int  # a rank holding the reference version: the repair source
    unrepairable: tuple[str, ...]  # diverged keys an in-place tensor broadcast cannot fix

    @property
    def ok(self) -> bool:
        return not self.diverged

    @property
    def reference_rank(self) -> int:
        return self.source

    @property
    def diverged_keys(self) -> list[str]:
        """The union of every rank's diverged keys, in ``keys`` order: the same list on every
        rank, so it can drive a collective (every rank must broadcast the same tensors)."""
        bad = {k for ks in self.diverged.values() for k in ks}
        return [k for k in self.keys if k in bad]

    @property
    def repairable(self) -> bool:
        return not self.unrepairable

    def describe(self, limit: int = 3) -> str:
        """A readable one-paragraph message: who diverged, in how many values, which ones."""
        n = len(self.keys)
        if self.ok:
            return f"All {self.world_size} replicas hold identical state ({n} values checked)."
        parts = []
        for rank, keys in sorted(self.diverged.items()):
            more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
            names = ", ".join(keys[:limit]) + more
            detail = []
            if self.missing.get(rank):
                detail.append(f"{len(self.missing[rank])} missing")
            if self.extra.get(rank):
                detail.append(f"{len(self.extra[rank])} extra")
            extra = f" [{', '.join(detail)}]" if detail else ""
            parts.append(f"rank {rank}: {len(keys)} of {n} values differ{extra} ({names})")
        text = (
            f"Replica divergence: {len(self.diverged)} of {self.world_size} ranks differ from the "
            f"majority; " + "; ".join(parts) + f". Reference copy: rank {self.source}."
        )
        if self.unrepairable:
            shown = ", ".join(self.unrepairable[:limit])
            text += (
                f" Not repairable by broadcast ({len(self.unrepairable)} keys missing, of other "
                f"dtype/shape, or not tensors: {shown})."
            )
        return text


def _vote(values: list[str | None], coordinator: int) -> str | None:
    """The majority value; a tie goes to the coordinator's value if it is among the tied, else
    to the value of the lowest tied rank (deterministic on every rank)."""
    counts = Counter(values)
    top = max(counts.values())
    tied = {v for v, c in counts.items() if c == top}
    if values[coordinator] in tied:
        return values[coordinator]
    return next(v for v in values if v in tied)


def compare(fingerprints_by_rank: Sequence[dict[str, str]], coordinator: int = 0) -> ReplicaReport:
    """Compare gathered fingerprints by a per-key majority vote (see ``_vote``; with two ranks
    the coordinator wins). A key absent on a rank votes "absent", so keys missing on a minority
    are reported as missing and keys present only on a minority as extra.

    The repair source is the coordinator if it agrees with the reference everywhere, else the
    lowest rank that does, else (no rank agrees on every key) the rank with the fewest diverged
    keys, ties to the coordinator then the lowest rank.
    """
    world = len(fingerprints_by_rank)
    if not 0 <= coordinator < world:
        raise ValueError(f"coordinator {coordinator} is not a rank of a world of {world}")
    order = [coordinator, *(r for r in range(world) if r != coordinator)]
    keys = list(dict.fromkeys(k for r in order for k in fingerprints_by_rank[r]))
    diverged: dict[int, list[str]] = {}
    missing: dict[int, list[str]] = {}
    extra: dict[int, list[str]] = {}
    unrepairable: list[str] = []
    for key in keys:
        values = [fps.get(key) for fps in fingerprints_by_rank]
        reference = _vote(values, coordinator)
        bad = [r for r, v in enumerate(values) if v != reference]
        if not bad:
            continue
        for r in bad:
            diverged.setdefault(r, []).append(key)
            if values[r] is None:
                missing.setdefault(r, []).append(key)
            elif reference is None:
                extra.setdefault(r, []).append(key)
        present = [v for v in values if v is not None]
        if (
            len(present) < world
            or not all(_is_tensor_fp(v) for v in present)
            or len({_meta(v) for v in present}) > 1
        ):
            unrepairable.append(key)
    if not diverged or coordinator not in diverged:
        source = coordinator
    else:
        agreeing = [r for r in range(world) if r not in diverged]
        source = (
            agreeing[0]
            if agreeing
            else min(order, key=lambda r: (len(diverged[r]), order.index(r)))
        )
    return ReplicaReport(
        world_size=world,
        coordinator=coordinator,
        keys=tuple(keys),
        diverged=diverged,
        missing=missing,
        extra=extra,
        source=source,
        unrepairable=tuple(unrepairable),
    )


# ---------------------------------------------------------------- distributed helpers


def gather_fingerprints(fp: dict[str, str], group: Any = None) -> list[dict[str, str]]:
    """Every rank's fingerprints, indexed by rank within ``group`` (``[fp]`` without a process
    group). With NCCL the current CUDA device must be set (``torch.cuda.set_device``), as for any
    ``all_gather_object``."""
    return collectives.gather(fp, group)


def check_replicas(
    state: Any, *, coordinator: int = 0, group: Any = None, values: bool = True
) -> ReplicaReport:
    """Fingerprint ``state``, gather every rank's fingerprints and compare them. A collective:
    every rank of ``group`` must call it; all get the same report."""
    return compare(gather_fingerprints(fingerprint(state, values=values), group), coordinator)


def broadcast_state_(
    tensors: Sequence[torch.Tensor],
    src: int,
    group: Any = None,
    *,
    bucket_bytes: int = 64 << 20,
) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s (its rank within ``group``).

    A collective: every rank passes the same number of tensors with the same dtypes, shapes and
    devices, in the same order. Tensors are packed into uint8 buckets of up to ``bucket_bytes``
    (one broadcast per bucket rather than per tensor); a single tensor larger than that goes
    alone, without a copy when contiguous. No-op without a process group.
    """
    if not collectives.is_distributed(group):
        return
    dist = torch.distributed
    root = dist.get_global_rank(group, src) if group is not None else src
    receiving = dist.get_rank() != root
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if bucket and (t.device != bucket[0].device or size + nbytes > bucket_bytes):
            _broadcast_bucket(bucket, root, group, receiving)
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        _broadcast_bucket(bucket, root, group, receiving)


def _broadcast_bucket(bucket: list[torch.Tensor], root: int, group: Any, receiving: bool) -> None:
    if len(bucket) == 1 and bucket[0].is_contiguous():
        with torch.no_grad():
            torch.distributed.broadcast(_raw(bucket[0].detach()), src=root, group=group)
        return
    with torch.no_grad():
        contiguous = [t.detach().contiguous() for t in bucket]
        buffer = torch.cat([_raw(c) for c in contiguous])
        torch.distributed.broadcast(buffer, src=root, group=group)
        if not receiving:
            return
        offset = 0
        for t, c in zip(bucket, contiguous):
            n = c.numel() * c.element_size()
            _raw(c).copy_(buffer[offset : offset + n])
            offset += n
            if not t.is_contiguous():  # ``contiguous`` made a copy: write it back
                t.copy_(c)


def select_tensors(state: Any, keys: Sequence[str] | None = None) -> list[torch.Tensor]:
    """The tensors of ``state`` at ``keys`` (paths as in ``fingerprint``), in that order; all
    tensor leaves in walk order when ``keys`` is None.

    Raises:
        KeyError: a key that is not a tensor leaf of ``state``.
    """
    tensors = {p: v for p, v in leaves(state) if isinstance(v, torch.Tensor)}
    if keys is None:
        return list(tensors.values())
    return [tensors[k] for k in keys]


def repair_(
    state: Any, report: ReplicaReport, *, group: Any = None, only_diverged: bool = True
) -> list[str]:
    """Make every rank's ``state`` tensors bitwise equal to rank ``report.source``'s, in place.
    A collective on ``group``; returns the keys broadcast.

    ``only_diverged`` (default) broadcasts just ``report.diverged_keys`` — cheap, and safe as a
    collective because the report, hence that list and its order, is identical on every rank.
    ``only_diverged=False`` broadcasts every tensor of the reference key order (``report.keys``):
    simplest and deterministic, and also rewrites values that differ in ways the fingerprints
    did not cover (skipped leaves), at the cost of moving the whole state.

    Raises:
        ReplicaDivergedError: on every rank alike, before any communication, when the
            divergence is not fixable by an in-place broadcast (see ``report.unrepairable``).
    """
    if report.unrepairable:
        raise ReplicaDivergedError(report)
    if report.ok and only_diverged:
        return []
    if only_diverged:
        keys = report.diverged_keys
    else:
        present = {p for p, v in leaves(state) if isinstance(v, torch.Tensor)}
        keys = [k for k in report.keys if k in present]
    # Each value comes from a rank that holds the majority's version of *that* value: when
    # every rank is odd in some value, no single rank holds the whole reference state.
    by_source: dict[int, list[str]] = {}
    for key in keys:
        by_source.setdefault(source_of(report, key), []).append(key)
    for source in sorted(by_source):  # the same order on every rank: the report is identical
        broadcast_state_(select_tensors(state, by_source[source]), source, group)
    return keys


def source_of(report: ReplicaReport, key: str) -> int:
    """A rank holding the majority's version of ``key``: the coordinator when it does, else the
    lowest rank that does (ranks outside ``report.diverged[rank]`` for that key)."""
    ranks = [report.coordinator, *(r for r in range(report.world_size) if r != report.coordinator)]
    for rank in ranks:
        if key not in report.diverged.get(rank, ()):
            return rank
    return report.source
