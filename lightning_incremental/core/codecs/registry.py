"""The codec registry: every chunk encoding the store writes or reads, by its manifest ``kind``.

A codec turns one chunk's raw bytes (and, for a delta codec, the same chunk of the previous
checkpoint) into a payload and back. The encoder chooses among the registered codecs, the
decoder and ``verify`` decode through them, and the manifest validator accepts exactly the
registered kinds — so adding a codec is registering one class (see :mod:`.zstd`).

A codec that is not ``lossless`` decodes to bytes that differ from what was saved: its chunks
are recorded with ``lossless: false`` and the hash of their *decoded* bytes, which restore
verifies instead of the raw hash. Lossy codecs are never chosen automatically; a store uses one
only for the keys its configuration names (``StoreConfig.lossy_codecs``, ``optimizer_state``).
A lossy delta codec takes the decoded bytes of a lossy chunk as its base (see :func:`delta_of`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import numpy as np


class BlockDecoder(Protocol):
    """A payload prepared for decoding range by range, in order: the links of a chain are then
    decoded together, each range from the chain's root to its last link while it is in cache,
    instead of each link's whole chunk in turn."""

    def decode(self, out: np.ndarray, start: int, stop: int) -> None:
        """Bytes ``[start, stop)`` of the chunk into the same range of ``out`` (uint8, the
        chunk's size) — which holds the base's bytes there, for a delta: decoded in place.
        ``start`` is a multiple of 8; ``stop`` too, or the chunk's size.

        Raises:
            ValueError: the payload does not decode.
        """


class Codec(ABC):
    """One chunk encoding.

    Attributes:
        kind: the short name manifests record (``"z"``, ``"x"``); unique in the registry.
        lossless: whether ``decode_into`` restores the raw bytes exactly.
        needs_base: whether payloads are relative to a base chunk (a delta): the manifest
            then names the base, and restore decodes the base first.
        raced: whether the encoder tries this codec on changed chunks (see :func:`automatic`);
            False for a codec kept to read the checkpoints of earlier versions.
        standalone: for a delta codec that already weighs itself against coding the chunk
            standalone by the codec of this kind (and declines, returning None, when that is
            smaller): the encoder then tries the delta alone and falls back to that codec. A
            lossy delta codec must name one: its base is a chunk of that codec (or of itself)
            as it decodes, and it decodes to what that codec would.
    """

    kind: ClassVar[str]
    lossless: ClassVar[bool] = True
    needs_base: ClassVar[bool] = False
    raced: ClassVar[bool] = True
    standalone: ClassVar[str | None] = None

    @abstractmethod
    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | memoryview | None:
        """The payload of ``raw`` (uint8), or None when this codec does not apply (a delta
        codec given no base). ``width``: the byte-group width of the tensor's elements;
        ``level``: the compression level configured.

        Raises:
            ValueError: ``base`` does not fit ``raw``.
        """

    @abstractmethod
    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        """Decode ``payload`` into ``out`` (uint8, the chunk's size).

        Raises:
            ValueError: the payload is not a valid encoding of ``out.size`` bytes, or a delta
                lacks its base. Callers turn this into a ``CorruptCheckpointError``.
        """

    def planes(self, payload: bytes | memoryview, size: int) -> np.ndarray | None:
        """The chunk in the byte-grouped domain in which the links of a delta chain combine by
        XOR (so a chain is decoded with one ungrouping), or None when the codec has no such
        form. Raises ValueError like ``decode_into``."""
        return None

    def foldable(self, payload: bytes | memoryview) -> bool:
        """Whether :meth:`planes` gives this payload's grouped form — a look at its header,
        nothing decoded: a chain is folded only when every link is. By default, whether the
        codec has :meth:`planes` at all. Raises ValueError like ``decode_into``."""
        return type(self).planes is not Codec.planes

    def blocks(self, payload: bytes | memoryview, size: int) -> BlockDecoder | None:
        """The payload read once and decodable range by range (see :class:`BlockDecoder`), or
        None when the codec cannot: then a chain holding it is decoded link by link. Raises
        ValueError like ``decode_into``."""
        return None

    # A delta codec that chooses among ways of coding a chunk (a predictor, or declining) may
    # expose that choice: the encoder remembers it for the same place of the next checkpoint,
    # whose chunk is then coded the same way without choosing again (see ``choose.Hint``).
    # A choice is advisory: any choice the codec gave must still code any chunk correctly.

    def choice(self, payload: bytes | memoryview | None) -> int | None:
        """The choice ``encode`` made for ``payload`` (None: it declined), for
        :meth:`encode_as`; None when the codec has no choice to remember."""
        return None

    def encode_as(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int, choice: int
    ) -> bytes | memoryview | None:
        """Like :meth:`encode`, coding ``raw`` the way ``choice`` (from :meth:`choice`) says
        instead of choosing again. By default: :meth:`encode`."""
        return self.encode(raw, base, width=width, level=level)


_lock = threading.Lock()
_codecs: dict[str, Codec] = {}


def register(codec: Codec, *, replace: bool = False) -> Codec:
    """Make ``codec`` available under ``codec.kind``; returns it.

    Raises:
        ValueError: the kind is taken (unless ``replace``), or not a short plain name.
    """
    kind = codec.kind
    if not isinstance(kind, str) or not kind.isascii() or not kind.isprintable() or not kind:
        raise ValueError(f"codec kind must be a short printable name, got {kind!r}")
    if len(kind) > 32:
        raise ValueError(f"codec kind {kind!r} is longer than 32 characters")
    if codec.needs_base and not codec.lossless and not codec.standalone:
        raise ValueError(
            f"codec {kind!r}: a lossy codec cannot be a delta (needs_base) unless it names the "
            "lossy standalone codec whose decoded chunks are its bases (standalone)"
        )
    with _lock:
        if kind in _codecs and not replace and _codecs[kind] is not codec:
            raise ValueError(f"a codec of kind {kind!r} is registered already")
        _codecs[kind] = codec
    return codec


def unregister(kind: str) -> None:
    """Remove a codec (manifests naming it no longer validate)."""
    with _lock:
        _codecs.pop(kind, None)


def get(kind: object) -> Codec:
    """The codec recording ``kind``.

    Raises:
        ValueError: no codec of that kind is registered.
    """
    codec = _codecs.get(kind) if isinstance(kind, str) else None
    if codec is None:
        raise ValueError(
            f"unknown chunk encoding {kind!r:.40} (known: {', '.join(sorted(_codecs))})"
        )
    return codec


def kinds() -> list[str]:
    """Every registered kind."""
    with _lock:
        return sorted(_codecs)


def automatic() -> list[Codec]:
    """The codecs the encoder races for a changed chunk: every lossless one that is ``raced``, in
    registration order (standalone codecs first by convention, so that ties go to them)."""
    with _lock:
        return [c for c in _codecs.values() if c.lossless and c.raced]


def delta_of(codec: Codec) -> Codec | None:
    """The lossy delta codec whose bases are ``codec``'s decoded chunks, if one is registered."""
    with _lock:
        for other in _codecs.values():
            if other.needs_base and not other.lossless and other.standalone == codec.kind:
                return other
    return None


def decode(
    payload: bytes | memoryview,
    kind: str,
    width: int,
    size: int,
    base: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one payload of ``kind`` into ``size`` bytes (into ``out`` when given).

    Raises:
        ValueError: unknown kind, a payload that is not a valid encoding of ``size`` bytes, or
            a delta without its base.
    """
    codec = get(kind)
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    elif out.size != size:
        raise ValueError(f"output holds {out.size} bytes, the chunk {size}")
    codec.decode_into(payload, out, base, width=width)
    return out
