"""The background save queue: one saver thread, back-pressure, and the handles of its saves.

``save`` takes a slot (blocking while ``max_in_flight`` saves are pending), snapshots, and
submits the rest of the save here; its :class:`SaveHandle` is a ``concurrent.futures.Future``
underneath. An error nobody collected through its handle is raised by the next ``save``,
``wait`` or ``close`` — once. Saves still pending when the interpreter exits are drained first.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from lightning_incremental.core.results import SaveResult
from lightning_incremental.core.save import at_exit
from lightning_incremental.core.workers import WorkerPool

log = logging.getLogger("lightning_incremental")


class SaveHandle:
    """A save running in the background. ``wait`` returns its result or raises its error."""

    def __init__(self, step: int, future: Future[SaveResult] | None = None) -> None:
        self.step = step
        self.future: Future[SaveResult] = future if future is not None else Future()
        self._done = threading.Event()  # set once finished, before any done-callback runs
        self._delivered = False
        self.future.add_done_callback(lambda _: self._done.set())

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the save is committed or failed.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            Exception: the save's own error (StorageError, UnsupportedValueError, ...).
        """
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.future.result()

    result = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until the save finished; its error (which then counts as delivered) or None.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        try:
            error = self.future.exception()
        except concurrent.futures.CancelledError as exc:
            error = exc
        if error is not None:
            self._delivered = True
        return error

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save committed or failed (at once if it already has).
        It runs on the store's background thread: keep it short, and do not call ``wait``
        expecting anything but an immediate answer."""

        def call(_: Future[SaveResult]) -> None:
            try:
                fn(self)
            except Exception:
                log.exception("a done-callback of the save of step %d raised", self.step)

        self.future.add_done_callback(call)

    def _undelivered_error_pending(self) -> bool:
        return self.done() and not self._delivered and self.future.exception() is not None

    def _undelivered_error(self) -> BaseException | None:
        """The save's error, once, if nobody collected it yet."""
        if not self._undelivered_error_pending():
            return None
        return self.exception(0)

    def __repr__(self) -> str:
        failed = self.done() and self.future.exception() is not None
        state = "failed" if failed else "committed" if self.done() else "pending"
        return f"SaveHandle(step={self.step}, {state})"


class SaveQueue:
    """Runs saves one at a time on a background thread, at most ``max_in_flight`` pending."""

    def __init__(self, max_in_flight: int, name: str = "li-save", *, nice: int = 0) -> None:
        self._worker = WorkerPool(1, name, nice=nice)
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []

    def reserve(self) -> None:
        """Take a slot: blocks while ``max_in_flight`` saves are pending (back-pressure). Pair
        with :meth:`submit`, or :meth:`cancel` when the save is given up before it."""
        self._slots.acquire()

    def cancel(self) -> None:
        self._slots.release()

    def submit(self, step: int, run: Callable[[], SaveResult]) -> SaveHandle:
        """Run ``run`` in the background as the save of ``step``; its slot is freed after."""

        def job() -> SaveResult:
            try:
                return run()
            finally:
                self._slots.release()

        handle = SaveHandle(step, self._worker.submit(job))
        with self._lock:
            self._handles = [
                h for h in self._handles if not h.done() or h._undelivered_error_pending()
            ] + [handle]
        return handle

    def pending(self, exclude: int | None = None) -> list[int]:
        """Steps of the saves not finished yet (except ``exclude``)."""
        with self._lock:
            return [h.step for h in self._handles if not h.done() and h.step != exclude]

    def raise_undelivered(self) -> None:
        """Raise the first error of a finished save that nobody collected yet (once)."""
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            error = handle._undelivered_error()
            if error is not None:
                raise error

    def wait(self) -> list[SaveResult]:
        """Wait for every pending save; their results, oldest first.

        Raises:
            Exception: the first error of a save that was not delivered yet.
        """
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            handle._done.wait()
        self.raise_undelivered()
        return [h.future.result() for h in handles if h.future.exception() is None]

    def threads(self) -> list[threading.Thread]:
        """The saver thread, while it runs."""
        return self._worker.threads()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)


class _Closable(Protocol):
    url: str

    def close(self) -> None: ...


def drain_at_exit(store: _Closable) -> None:
    """Close ``store`` (waiting for its saves) when the interpreter exits, if still open (see
    :mod:`lightning_incremental.core.save.at_exit`: Python stops thread pools from accepting work at
    shutdown, so the stores drain first)."""
    at_exit.drain_at_exit(store, _close)


def _close(store: _Closable) -> None:
    try:
        store.close()
    except Exception as exc:  # the process is ending: say what was lost, loudly
        log.error("a checkpoint of %s failed while the process was exiting: %s", store.url, exc)
