"""The background work of :class:`~.checkpoint_io.IncrementalCheckpointIO`: one worker thread
that commits saves and releases replaced steps, in the order they were asked for, and keeps every
job's error until it is delivered.

``save_checkpoint`` blocks only while the engine snapshots the state (one host copy, no second
device copy) and the pointer file is written; encoding, writing and committing the step happen
here. A background error surfaces at the plug-in's next ``save_checkpoint``/``load_checkpoint``/
``remove_checkpoint``, at its ``wait``, or at ``teardown`` (which Lightning calls at the end of
every ``fit/validate/test/predict``, also when they fail) — never lost. A save that failed to
commit (storage error, full disk) is logged and warned about there, and training goes on from the
previous checkpoint (the save's file keeps naming it); ``max_consecutive_failures`` failed saves
in a row raise ``CheckpointError`` instead. Other background errors (releasing a replaced step)
are raised.

Threads: a store this process only reads or removes from is closed when that call returns
(:mod:`~.removal`). The worker and the stores' threads run only while there is work
(:class:`~lightning_incremental.core.workers.WorkerPool`: daemon threads that end after a short
idle time); saves in flight at interpreter exit are finished by an exit hook
(:mod:`lightning_incremental.core.save.at_exit`). A job tracked under a store URL makes every
load of that store in this process wait for it, whatever plug-in instance loads
(:mod:`lightning_incremental.core.save.inflight`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from lightning_incremental.core.save import inflight
from lightning_incremental.core.save.at_exit import drain_at_exit
from lightning_incremental.core.workers import BACKGROUND_NICE, WorkerPool

log = logging.getLogger(__name__)


class BackgroundJobs:
    """The plug-in's background jobs, oldest first, and the pointer job of each path's newest
    save (what a removal of that path waits for)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: WorkerPool | None = None
        self._jobs: list[Future[None]] = []  # background work, oldest first
        self._pending: dict[str, Future[None]] = {}  # path -> its save's pointer job

    def submit(
        self, work: Callable[[], None], what: str, *, track: str | None = None
    ) -> Future[None]:
        """Run ``work`` on the background thread (which ends when idle). ``track``: a store URL
        whose loads in this process wait for this work (a save's commit and the pointer-file
        bookkeeping after it), whatever plug-in instance loads."""

        def run() -> None:
            try:
                work()
            except BaseException as exc:
                log.error("IncrementalCheckpointIO: %s failed: %s", what, exc)
                raise

        with self._lock:
            if self._executor is None:
                self._executor = WorkerPool(1, "li-checkpoint-io", nice=BACKGROUND_NICE)
            # drained at exit before the stores it opened so far (newest registration first)
            drain_at_exit(self, _finish_jobs)
            # finished jobs stay only while their error is undelivered
            self._jobs = [j for j in self._jobs if not j.done() or j.exception() is not None]
            self._pending = {k: j for k, j in self._pending.items() if not j.done()}
            job = self._executor.submit(run)
            self._jobs.append(job)
        if track is not None:
            done = threading.Event()
            inflight.track(track, done)
            job.add_done_callback(lambda _: done.set())
        return job

    def set_pending(self, key: str, job: Future[None]) -> None:
        with self._lock:
            self._pending[key] = job

    def pending(self, key: str) -> Future[None] | None:
        """The pointer job of the newest save to the path ``key``, if it may still run."""
        return self._pending.get(key)

    def wait(self) -> None:
        """Block until every job submitted so far finished (errors stay undelivered)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.exception()

    def undelivered(self) -> list[BaseException]:
        """Errors of finished jobs, each returned once."""
        with self._lock:
            done = [j for j in self._jobs if j.done()]
            self._jobs = [j for j in self._jobs if j not in done]
        return [e for e in (j.exception() for j in done) if e is not None]

    def raise_first(self) -> None:
        """Raise the first undelivered error (if any); log the others."""
        errors = self.undelivered()
        for extra in errors[1:]:
            log.error("another background checkpoint error: %r", extra)
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        """Forget every job and end the thread (waiting for what it runs)."""
        with self._lock:
            executor, self._executor = self._executor, None
            self._jobs, self._pending = [], {}
        if executor is not None:
            executor.shutdown(wait=True)


def _finish_jobs(jobs: BackgroundJobs) -> None:
    """Let saves still in flight when the interpreter exits commit and get their pointer file
    (see :mod:`lightning_incremental.core.save.at_exit`).

    A save made after ``teardown`` (``trainer.save_checkpoint`` after ``fit``, ``ddp_spawn``
    handing the weights back to the main process) may still be running when the script ends.
    """
    jobs.wait()  # failures were logged when they happened


def raise_first(errors: list[BaseException], when: str) -> None:
    """Raise the first of ``errors`` (if any); log the others, which would be lost."""
    for extra in errors[1:]:
        log.error("another checkpoint error %s: %r", when, extra)
    if errors:
        raise errors[0]
