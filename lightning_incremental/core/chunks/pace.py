"""Pacing a save (``codec_effort="auto"``): a changed chunk the codec shrinks little is coded in
full only where that costs the save no time — when its coding ends before the writers run out
of work; one it shrinks to less than half is always coded.

The save's time to durable is the longer of two streams: the encoder's (coding chunks) and the
writers' (writing packs and fsyncing them). Storing a chunk as it is costs the encoder nothing
and the writers its raw size; coding it costs the encoder its coding time and saves the
writers the bytes it removes. So a chunk is worth coding while the writers have work queued
that outlasts it: the chunks being coded, this one included, end before the bytes already
handed to the writers are written. Where storage is slower than the codec (an object store, a
network file system, a busy disk) that holds for every chunk and every chunk is coded; where the
codec is slower (a local NVMe disk takes 1.3 GB/s or more, one encoding thread codes well under
1 GB/s) the save codes what the disk's time allows and stores the rest as it is, and becomes
durable about when a save of the raw bytes would — ``zstd --adapt``'s rule, per chunk.

**Bytes first where the codec earns them.** A chunk whose place (tensor, chunk index) the codec
shrank to less than ``PACE_FROM`` of its raw size the last time it coded it is always coded: a
sparse update's XOR delta, a bf16 state, a fine-tuned layer's delta. (Paced without this rule,
the benchmark's sparse embedding wrote 24.8 MB a checkpoint instead of 4.5 MB, to be durable
in 0.26 s instead of 0.30 s.) Pacing trades only where coding buys little: dense float32
updates, whose low mantissa bytes are noise (a 209 MB AdamW state on a machine whose disk
outruns its codec: coded in full, 161.5 MB a checkpoint, durable in 2.6x ``torch.save`` +
fsync; paced, 182-197 MB in 1.6-1.8x). A place not coded yet takes
the ratio its tensor's places last coded to (the same kind: standalone or delta) — a tensor's
chunks are alike far more often than not, and a full base of dense weights is then paced from
its second chunk on instead of coded in full — and is coded where its tensor has none yet (its
ratio is learnt). Every place is coded again every ``RELEARN`` saves it was stored as it is
(the data may have changed character, or was never like its tensor's first chunk: a phase of
dense updates ends, a padded embedding's zero rows). A place's ratio is kept apart for a delta
(a base was at hand) and a standalone chunk: a full base's random weights shrink little, their
later small steps much.

Both rates are measured as the saves run (per thread, smoothed over the last chunks and
writes, each weighted by its bytes; kept by the store from one save to the next), so a
machine's real figures decide, not an assumed ratio. A pack's write is measured once it is
durable: its write and its share of the sync at the end of the save (a disk that takes writes
into memory at once may be slow to make them durable); until one is, in a store's first save,
the writes alone stand for the writers' rate. Before a rate is known every chunk is coded; so
is every chunk a save schedules before its first pack is handed over, once it holds 2 MiB
(:class:`~.packs.PackWriter`): a save whose changes fit there (with the default 4 MiB chunks:
one changed chunk, and the few scheduled while it is coded) is coded in full whatever the
disk. Small tensors packed first end that earlier.
"""

from __future__ import annotations

import threading
import zlib

SMOOTHING = 0.25  # weight of the newest measurement in a rate (an exponential moving average)
PACE_FROM = 0.5  # a place its codec shrank below this fraction of its raw bytes is always coded
RELEARN = 8  # a place stored as it is this many times is coded again, its ratio measured anew


class Pacer:
    """The measured rates of one store's encoding and writing threads, and the choice they make
    for each changed chunk (see the module documentation). Thread-safe: writers report from
    their own threads."""

    def __init__(self, workers: int, writers: int) -> None:
        self.workers, self.writers = max(1, workers), max(1, writers)
        self._code = _Rate()  # raw bytes per second one encoding thread codes
        self._write = _Rate()  # bytes per second one writer thread writes (and syncs)
        self._written = _Rate()  # the same, writes alone (until a pack was synced)
        # (tensor key, chunk index, delta) -> (coded / raw bytes last time, saves stored as is)
        self._ratios: dict[tuple[str, int, bool], tuple[float, int]] = {}
        # (tensor key, delta) -> the ratio its places last coded to: a new place's estimate
        self._tensors: dict[tuple[str, bool], float] = {}
        self._lock = threading.Lock()

    @property
    def code_bps(self) -> float | None:
        return self._code.bps()

    @property
    def write_bps(self) -> float | None:
        synced = self._write.bps()
        return synced if synced is not None else self._written.bps()

    def coded(
        self,
        nbytes: int,
        seconds: float,
        place: tuple[str, int] | None = None,
        size: int = 0,
        *,
        delta: bool = False,
    ) -> None:
        """An encoding thread coded a chunk of ``nbytes`` raw bytes in ``seconds``, at
        ``place``, into ``size`` bytes (``delta``: with a base at hand)."""
        with self._lock:
            self._code.add(nbytes, seconds)
            if place is not None and nbytes > 0:
                known = (*place, delta) in self._ratios
                self._ratios[(*place, delta)] = (size / nbytes, 0 if known else _first_age(place))
                self._tensors[(place[0], delta)] = size / nbytes

    def stored(self, place: tuple[str, int], *, delta: bool = False) -> None:
        """A chunk at ``place`` was stored as it is (counts towards re-learning its ratio; a
        place stored on its tensor's ratio keeps that ratio, as if it had coded to it)."""
        with self._lock:
            known = self._ratios.get((*place, delta))
            if known is not None:
                self._ratios[(*place, delta)] = (known[0], known[1] + 1)
                return
            prior = self._tensors.get((place[0], delta))
            if prior is not None:
                self._ratios[(*place, delta)] = (prior, _first_age(place) + 1)

    def ratio(self, place: tuple[str, int], *, delta: bool = False) -> float | None:
        """Coded bytes over raw bytes at ``place`` the last time it was coded, or None (never
        coded, or due to be measured anew)."""
        known = self._ratios.get((*place, delta))
        return known[0] if known is not None and known[1] < RELEARN else None

    def estimate(self, place: tuple[str, int], *, delta: bool = False) -> float | None:
        """What pacing goes by at ``place``: its :meth:`ratio`; for a place never coded, the
        ratio its tensor's places last coded to; None (code it, to learn) where neither is
        known, or the place is due to be measured anew."""
        known = self._ratios.get((*place, delta))
        if known is not None:
            return known[0] if known[1] < RELEARN else None
        return self._tensors.get((place[0], delta))

    def forget_except(self, keys: set[str]) -> None:
        """Forget the places of tensors not in ``keys`` (gone from the state)."""
        with self._lock:
            self._ratios = {p: r for p, r in self._ratios.items() if p[0] in keys}
            self._tensors = {t: r for t, r in self._tensors.items() if t[0] in keys}

    def wrote(self, nbytes: int, seconds: float) -> None:
        """A writer thread wrote and synced ``nbytes`` in ``seconds``."""
        with self._lock:
            self._write.add(nbytes, seconds)

    def wrote_unsynced(self, nbytes: int, seconds: float) -> None:
        """A writer thread wrote ``nbytes`` in ``seconds``, not synced yet: the writers' rate
        until a pack was measured to durable (:meth:`wrote`)."""
        with self._lock:
            self._written.add(nbytes, seconds)

    def code(self, *, nbytes: int, coding: int, unwritten: int, ratio: float | None = None) -> bool:
        """Whether to code a changed chunk of ``nbytes`` now, with ``coding`` chunks (about as
        large) being coded and ``unwritten`` bytes handed to the writers and not written yet:
        whether those chunks and this one are coded before the writers have written them —
        always where its place coded to ``ratio`` (coded over raw bytes; :meth:`estimate`)
        under ``PACE_FROM``, or nothing is known of it (None)."""
        if not shrinks_little(ratio):
            return True
        code_bps, write_bps = self.code_bps, self.write_bps
        if code_bps is None or write_bps is None:
            return True  # nothing measured yet
        coding_s = (coding + 1) * nbytes / (code_bps * self.workers)
        writing_s = unwritten / (write_bps * self.writers)
        return coding_s <= writing_s


class _Rate:
    """Bytes per second over the recent measurements, each weighted by its bytes: moving
    averages of the bytes and of the seconds (a 2 MiB write's fixed cost weighs what its
    bytes do, not what a 16 MiB one's does)."""

    def __init__(self) -> None:
        self.nbytes = self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        if not self.seconds:
            self.nbytes, self.seconds = float(nbytes), seconds
            return
        self.nbytes = (1 - SMOOTHING) * self.nbytes + SMOOTHING * nbytes
        self.seconds = (1 - SMOOTHING) * self.seconds + SMOOTHING * seconds

    def bps(self) -> float | None:
        return self.nbytes / self.seconds if self.seconds else None


def _first_age(place: tuple[str, int]) -> int:
    """The age a place's ratio starts at: the first re-learning of a tensor's places is spread
    over RELEARN saves."""
    return zlib.crc32(f"{place[0]}:{place[1]}".encode()) % RELEARN


def shrinks_little(ratio: float | None) -> bool:
    """Whether a place coded to ``ratio`` (coded over raw bytes; None: never coded) is one
    pacing may store as it is: known, and at least ``PACE_FROM``."""
    return ratio is not None and ratio >= PACE_FROM
