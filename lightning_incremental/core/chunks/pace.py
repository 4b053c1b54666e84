"""Pacing a save (``codec_effort="auto"``): a changed chunk is coded in full only where that
costs the save no time — when its coding ends before the writers run out of work.

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

Both rates are measured as the saves run (per thread, smoothed over the last chunks and
writes; kept by the store from one save to the next), so a machine's real figures decide, not
an assumed ratio. Before a rate is known every chunk is coded; so is every chunk a save codes
before its first pack is handed over (see :class:`~.packs.PackWriter`): a save of a few changed
chunks is coded in full, whatever the disk.
"""

from __future__ import annotations

import threading

SMOOTHING = 0.25  # weight of the newest measurement in a rate (an exponential moving average)


class Pacer:
    """The measured rates of one store's encoding and writing threads, and the choice they make
    for each changed chunk (see the module documentation). Thread-safe: writers report from
    their own threads."""

    def __init__(self, workers: int, writers: int) -> None:
        self.workers, self.writers = max(1, workers), max(1, writers)
        self.code_bps: float | None = None  # raw bytes per second one encoding thread codes
        self.write_bps: float | None = None  # bytes per second one writer thread writes
        self._lock = threading.Lock()

    def coded(self, nbytes: int, seconds: float) -> None:
        """An encoding thread coded a chunk of ``nbytes`` raw bytes in ``seconds``."""
        with self._lock:
            self.code_bps = _smoothed(self.code_bps, nbytes, seconds)

    def wrote(self, nbytes: int, seconds: float) -> None:
        """A writer thread wrote (and synced) ``nbytes`` in ``seconds``."""
        with self._lock:
            self.write_bps = _smoothed(self.write_bps, nbytes, seconds)

    def code(self, *, nbytes: int, coding: int, unwritten: int) -> bool:
        """Whether to code a changed chunk of ``nbytes`` now, with ``coding`` chunks (about as
        large) being coded and ``unwritten`` bytes handed to the writers and not written yet:
        whether those chunks and this one are coded before the writers have written them."""
        code_bps, write_bps = self.code_bps, self.write_bps
        if code_bps is None or write_bps is None:
            return True  # nothing measured yet
        coding_s = (coding + 1) * nbytes / (code_bps * self.workers)
        writing_s = unwritten / (write_bps * self.writers)
        return coding_s <= writing_s


def _smoothed(rate: float | None, nbytes: int, seconds: float) -> float | None:
    if nbytes <= 0 or seconds <= 0:
        return rate
    new = nbytes / seconds
    return new if rate is None else (1 - SMOOTHING) * rate + SMOOTHING * new
