"""What the store's operations return: save results and handles, verify and gc reports."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("lightning_incremental")


@dataclass(frozen=True)
class SaveResult:
    """Figures of one committed save.

    Attributes:
        step: the checkpoint's step.
        bytes_logical: bytes of tensor data in the state (what a plain copy would hold).
        bytes_written: bytes written to storage: new pack objects plus the manifest.
        snapshot_s: seconds the caller of ``save`` was blocked (back-pressure wait included).
        wait_s: the part of ``snapshot_s`` spent waiting for earlier saves (back-pressure).
        encode_s: seconds spent hashing, delta-encoding and compressing (summed over workers).
        write_s: seconds spent writing objects and the manifest (summed over writers).
        total_s: seconds from ``save`` being called to the checkpoint being committed.
        full_base: whether this checkpoint is a full base (no chunk depends on a delta).
        chunks_total / chunks_reused / chunks_delta / chunks_full: chunks in the state; of them,
            referenced from earlier checkpoints, written as XOR deltas, written standalone.
        objects_written: pack objects written (the manifest not included).
        warnings: what went wrong after the commit (retention), each a sentence; the
            checkpoint is committed regardless.
    """

    step: int
    bytes_logical: int
    bytes_written: int
    snapshot_s: float
    wait_s: float
    encode_s: float
    write_s: float
    total_s: float
    full_base: bool
    chunks_total: int
    chunks_reused: int
    chunks_delta: int
    chunks_full: int
    objects_written: int
    warnings: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """Logical bytes per byte written (higher is better)."""
        return self.bytes_logical / self.bytes_written if self.bytes_written else float("inf")


class SaveHandle:
    """A save running in the background. ``wait`` returns its result or raises its error."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._delivered = False
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._callbacks_lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the save is committed or failed.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            Exception: the save's own error (StorageError, UnsupportedValueError, ...).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            self._delivered = True
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until the save finished; its error (which then counts as delivered) or None.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            self._delivered = True
        return self._error

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save committed or failed (at once if it already has).
        It runs on the store's background thread: keep it short, and do not call ``wait``
        expecting anything but an immediate answer."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        with self._callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("a done-callback of the save of step %d raised", self.step)

    def _undelivered_error(self) -> BaseException | None:
        if self._done.is_set() and self._error is not None and not self._delivered:
            self._delivered = True
            return self._error
        return None

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self._done.is_set() else "pending"
        return f"SaveHandle(step={self.step}, {state})"


@dataclass
class ObjectCheck:
    """One stored object checked by ``verify``."""

    path: str
    ok: bool
    size: int = 0
    error: str | None = None


@dataclass
class VerifyReport:
    """Every object of one checkpoint checked, and every chunk decoded and hash-compared."""

    step: int
    objects: list[ObjectCheck] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(o.ok for o in self.objects)


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``) and what it kept."""

    kept_steps: list[int]
    removed_steps: list[int]
    removed_objects: list[str]
    bytes_freed: int
    dry_run: bool = False
    # A checkpoint kept beyond keep_last because no other kept one is intact, if any.
    kept_intact: int | None = None
