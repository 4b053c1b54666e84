"""``codec_effort="auto"``: when a save stores its changed chunks as they are (codec ``s``, no
codec CPU) instead of coding them in full.

Two signals, each measured by the saves themselves:

- **contended**: the save's encoding thread waited for a CPU longer than it ran
  (:func:`~lightning_incremental.core.workers.cpu_times`; measured when it ran at least
  ``MIN_RUN_S``): training keeps every core busy, and the codec's CPU would come out of
  training's. Measured at every save, fast ones too: it clears once a core is free again. Our
  own threads sharing a single free core can also make it wait about as long as it runs: then
  some saves are stored as they are although training lost nothing (more bytes, not more
  training time). A stricter ratio (3) was measured and dropped: with training on every core,
  the waits of our lower-priority thread stayed under it often enough that the codec's CPU
  came out of training again (overhead every 10 steps +23 % against +9 %).
- **behind**: a save was asked for while the one before it, coded in full (and taking at least
  ``MIN_BEHIND_S``), was still running: at this rate saves queue up and training waits for
  them (back-pressure), however free the cores are. While behind, every ``PROBE_EVERY``-th
  save is coded in full again to see whether it still is.

Either makes the next save fast; ``"full"`` and ``"fast"`` fix the choice.

Otherwise a save is **paced** (:mod:`~lightning_incremental.core.chunks.pace`): a changed chunk
whose place the codec shrank to less than half is coded; one it shrinks little is coded only while
its coding ends before the writers run out of work, else stored as it is. Where storage is slower
than the codec every chunk is coded; where the codec is slower (a local NVMe disk) the save becomes
durable about when a save of the raw bytes would, with as many fewer bytes as the disk's time
allowed. Coded in full on such a disk, a dense 1 GB save took 2.1x ``torch.save`` + fsync to be
durable, a 4 GB one 2.9x.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_RUN_S = 0.02  # a save shorter than this on a CPU says nothing about contention
CONTENDED = 1.0  # waiting longer than running (times this): the cores are training's
MIN_BEHIND_S = 0.05  # a save coded in full in less than this is not what holds training up
PROBE_EVERY = 8  # while behind, every this-many-th save is coded in full to measure again


@dataclass
class Effort:
    """The choice for one store (see the module documentation)."""

    setting: str = "auto"
    contended: bool = False
    behind: bool = False
    full_s: float | None = None  # how long the last save coded in full took to encode
    _last_fast = False
    _fast_in_a_row = 0

    def started(self, busy: bool) -> None:
        """A save was asked for; ``busy``: the one before it was still running."""
        if self.setting != "auto" or self._last_fast:
            return
        self.behind = busy and self.full_s is not None and self.full_s >= MIN_BEHIND_S

    def fast(self) -> bool:
        """Whether the save starting now stores its changed chunks as they are."""
        if self.setting != "auto":
            return self.setting == "fast"
        if self.contended:
            return True
        return self.behind and self._fast_in_a_row < PROBE_EVERY

    def paced(self) -> bool:
        """Whether the save starting now codes a changed chunk only where that costs no time
        (:mod:`~lightning_incremental.core.chunks.pace`; when it is not :meth:`fast`)."""
        return self.setting == "auto"

    def observe(
        self, *, fast: bool, seconds: float, cpu_run_s: float, cpu_wait_s: float
    ) -> str | None:
        """A save finished encoding in ``seconds``; a sentence for the log when the choice for
        the next save changes (None otherwise)."""
        if self.setting != "auto":
            return None
        before = self.fast()
        if cpu_run_s >= MIN_RUN_S:
            self.contended = cpu_wait_s > CONTENDED * cpu_run_s
        self._last_fast = fast
        if fast:
            self._fast_in_a_row += 1
        else:
            self._fast_in_a_row = 0
            self.full_s = seconds
        after = self.fast()
        if after == before or (not after and self.behind):  # a probe: said once, when it ends
            return None
        if self.contended:
            return (
                f"the save's background thread waited longer for a CPU than it ran "
                f"({1e3 * cpu_wait_s:.0f} ms waiting, {1e3 * cpu_run_s:.0f} ms running): changed "
                "chunks are stored as they are (more bytes, less CPU) for now"
            )
        if after:
            return (
                f"saves are asked for faster than a save coded in full ({self.full_s:.2f} s) "
                "ends: changed chunks are stored as they are (more bytes, less CPU) for now"
            )
        return "a core is free and saves keep up: changed chunks are coded in full again"
