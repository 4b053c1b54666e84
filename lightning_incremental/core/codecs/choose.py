"""Choosing a changed chunk's encoding: the smallest of the registered lossless codecs.

Compressing with every codec costs that many times the CPU. For a chunk of at least
``SAMPLE_MIN`` bytes each codec is first tried on a sample (``SAMPLE_SLICES`` slices spread over
the chunk); a codec that loses by more than ``SAMPLE_MARGIN`` there is not tried in full. Either
way the result is exact — only the choice between lossless encodings is estimated.

A delta codec that names a ``standalone`` codec makes that choice itself (see
:class:`~.registry.Codec`): with a base, the standalone codec is not raced beside it; it codes
the chunk only when the delta declines or would pass the chain bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_incremental.core.codecs import registry
from lightning_incremental.core.codecs.registry import Codec

SAMPLE_MIN = 256 << 10
SAMPLE_SLICES = 4
SAMPLE_SLICE = 16 << 10
SAMPLE_MARGIN = 0.10


@dataclass(frozen=True)
class Hint:
    """A delta codec's choice for one chunk (see ``Codec.choice``), to code the same place of
    the next checkpoint the same way."""

    kind: str
    choice: int


def _sample(data: np.ndarray) -> np.ndarray:
    stride = data.size // SAMPLE_SLICES
    return np.concatenate(
        [data[i * stride : i * stride + SAMPLE_SLICE] for i in range(SAMPLE_SLICES)]
    )


def encode_best(
    raw: np.ndarray,
    base: np.ndarray | None,
    width: int,
    level: int,
    *,
    delta_budget: float = math.inf,
    candidates: Sequence[Codec] | None = None,
) -> tuple[Codec, bytes | memoryview]:
    """The smallest encoding of ``raw`` among ``candidates`` (default: every registered
    lossless codec); a delta codec (``needs_base``) competes only with a ``base``, and only
    while its payload stays within ``delta_budget`` bytes (the chain bound). Ties go to the
    candidate listed first.

    Raises:
        ValueError: no candidate applies (there is no standalone codec among them).
    """
    codec, payload, _ = encode_choice(
        raw, base, width, level, delta_budget=delta_budget, candidates=candidates
    )
    return codec, payload


def encode_choice(
    raw: np.ndarray,
    base: np.ndarray | None,
    width: int,
    level: int,
    *,
    delta_budget: float = math.inf,
    candidates: Sequence[Codec] | None = None,
    hint: Hint | None = None,
) -> tuple[Codec, bytes | memoryview, Hint | None]:
    """:func:`encode_best`, and the choice the delta codec made (see ``Codec.choice``) when one
    self-weighing delta codec (one that names its ``standalone`` codec) was coded in full:
    given back as ``hint``, the same place of the next checkpoint is coded that way without
    choosing again. A ``hint`` for a codec that is not among the candidates is ignored."""
    everything = registry.automatic() if candidates is None else list(candidates)
    pool = [c for c in everything if base is not None or not c.needs_base]
    covered = {c.standalone for c in pool if c.needs_base and c.standalone}
    fallback = [c for c in pool if c.kind in covered]
    pool = [c for c in pool if c.kind not in covered]

    def code(
        codec: Codec, data: np.ndarray, against: np.ndarray | None
    ) -> bytes | memoryview | None:
        if hint is not None and hint.kind == codec.kind:
            return codec.encode_as(data, against, width=width, level=level, choice=hint.choice)
        return codec.encode(data, against, width=width, level=level)

    if fallback and delta_budget < raw.size * (1 + SAMPLE_MARGIN) and raw.size >= SAMPLE_MIN:
        # Near the chain bound: a delta whose sample already projects past it is not coded.
        # (Further from it the projection is not worth its cost: a delta codec that names a
        # standalone one declines rather than grow past the chunk's raw size.)
        s_raw, s_base = _sample(raw), _sample(base) if base is not None else None
        scale = raw.size / s_raw.size
        for codec in [c for c in pool if c.needs_base and c.standalone in covered]:
            payload = code(codec, s_raw, s_base)
            if payload is None or len(payload) * scale > delta_budget * (1 + SAMPLE_MARGIN):
                pool.remove(codec)
    if len(pool) > 1 and raw.size >= SAMPLE_MIN:
        s_raw = _sample(raw)
        s_base = _sample(base) if base is not None else None
        sizes = {}
        for codec in pool:
            payload = codec.encode(s_raw, s_base, width=width, level=level)
            if payload is not None:
                sizes[codec.kind] = len(payload)
        if sizes:
            best = min(sizes.values())
            pool = [c for c in pool if sizes.get(c.kind, 0) * (1 - SAMPLE_MARGIN) <= best]
    chosen: tuple[Codec, bytes | memoryview] | None = None
    made: Hint | None = None
    for codec in pool:
        payload = code(codec, raw, base)
        if len(pool) == 1 and codec.needs_base and codec.standalone:
            choice = codec.choice(payload)
            made = Hint(codec.kind, choice) if choice is not None else None
        if payload is None or (codec.needs_base and len(payload) > delta_budget):
            continue
        if chosen is None or len(payload) < len(chosen[1]):
            chosen = codec, payload
    if chosen is None:  # declined, or every sampled winner was a delta past the chain bound
        for codec in [*fallback, *everything]:
            if not codec.needs_base:
                payload = codec.encode(raw, None, width=width, level=level)
                if payload is not None:
                    return codec, payload, made
        raise ValueError("no standalone codec among the candidates")
    return chosen[0], chosen[1], made
