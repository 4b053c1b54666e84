"""Peak extra host memory of an operation: the kernel's resident-set high-water mark.

Before the operation: collect garbage, ``malloc_trim(0)`` (glibc hands its free pages back to the
kernel, so memory freed by an earlier system is not silently reused), then reset the high-water
mark by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, no privileges needed) and read
``VmRSS``. After it: ``VmHWM - VmRSS(before)``. The kernel tracks the high-water mark itself, so
a transient peak is caught however short, in every thread of the process (background writers
included), for tensors and Python objects alike.

Limits: resident pages only (memory allocated but never touched does not count, file pages
mapped by ``mmap`` do, the page cache does not); page granularity; allocator caches that the
trim cannot release (glibc arenas of other threads partly) may be reused without showing;
another thread of this process allocating meanwhile would be counted (the harness runs nothing
else during a save). Where ``clear_refs`` cannot be written the figure is ``None``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Peak:
    extra_bytes: int | None = None  # high-water mark minus the resident set before; None: unknown


@contextmanager
def peak_extra_rss() -> Iterator[Peak]:
    """``with peak_extra_rss() as peak: ...``; then ``peak.extra_bytes``."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    before = _status_kib("VmRSS") if _reset_high_water_mark() else None
    peak = Peak()
    yield peak
    high = _status_kib("VmHWM")
    if before is not None and high is not None:
        peak.extra_bytes = max(0, high - before) * 1024
