"""Worker threads that exist only while there is work.

``concurrent.futures.ThreadPoolExecutor`` keeps its (non-daemon) threads until it is shut down or
garbage-collected: a store or plug-in that saved once and is still referenced holds idle threads
for as long as the program runs, and test harnesses that look for leaked threads report them.

:class:`WorkerPool` is an ``Executor`` whose threads end after ``idle_s`` seconds without work
and are started again on the next ``submit``. They are daemon threads, so an idle pool never
delays the interpreter's exit; work still queued or running at exit is waited for by the owner's
exit hook (the store's, which closes every open store), not by the threads' being non-daemon.
Each thread can also be stopped on its own (``thread.stop()``: it ends once no work is queued),
as test harnesses that end the daemon threads a test left behind expect.

Background work yields to training. What a user pays for checkpointing is lost training
throughput, and a thread of ours that takes a core from an OpenMP team costs more than its own
time (a parallel region waits for its slowest thread). So:

- a pool's threads run at a lower OS priority (``nice``: on Linux, ``setpriority`` of the thread
  alone, relative to the main thread's; elsewhere the process's priority cannot be lowered for
  one thread, and they run at the normal priority). Under contention the scheduler gives the
  training threads the cores; our work runs in the gaps and on the cores training leaves free.
- :func:`free_cores` sizes the pools to the cores training leaves free.
- the work on these threads is numpy, zstd, xxhash and file I/O, never a torch operator: a
  torch operator run on a thread of ours would start an OpenMP team of its own, as wide as the
  training's.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds a worker thread waits for more work before it ends.
DEFAULT_IDLE_S = 1.0
#: How far below training's our background threads' priority is by default (``nice``).
BACKGROUND_NICE = 10
#: The most encoding threads an automatic pool size gives.
MAX_AUTO_WORKERS = 4
#: The most decoding threads an automatic restore pool gives (see :func:`restore_cores`).
MAX_RESTORE_WORKERS = 8


def lower_priority(nice: int) -> bool:
    """Lower the calling thread's scheduling priority by ``nice`` (0..19) relative to the main
    thread's; True when it was applied (Linux, where ``setpriority`` of a thread id acts on that
    thread alone). Raising a priority needs privileges and is never tried."""
    if nice <= 0 or not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's niceness
        target = min(19, base + nice)
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) >= target:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # a sandbox that forbids it: run at the normal priority
        return False
    return True


def cpu_times() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one (Linux's
    ``/proc/thread-self/schedstat``), or None where the kernel does not say. The second is the
    cost of contention: a thread that waits longer than it runs shares its cores with busier
    work (training, at a higher priority)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def free_cores(training_threads: int | None = None) -> int:
    """How many encoding threads a store starts: the cores this process may run on that the
    training's own threads leave free, at least 1 and at most :data:`MAX_AUTO_WORKERS`.

    ``training_threads``: default ``torch.get_num_threads()`` (the intra-op threads CPU training
    keeps busy), or 1 when CUDA is in use (one Python thread feeds the device; its intra-op
    threads idle)."""
    if training_threads is None:
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        training_threads = 1 if cuda else torch.get_num_threads()
    return max(1, min(MAX_AUTO_WORKERS, usable_cores() - training_threads))


def restore_cores() -> int:
    """How many threads a restore decodes on: every core this process may run on, at most
    :data:`MAX_RESTORE_WORKERS`.

    Unlike a save's, a restore's work is not background work: its caller waits for it, as for
    ``torch.load``, and training has not started (or is paused for it), so there are no
    training threads to leave cores to. Decoding on the save's pool (sized to the cores
    training leaves free: one on a machine of two) left every other core idle: the restore
    of a coded 256 MB base took 1.6x ``torch.load`` on one thread, 1.0x on two."""
    return max(1, min(MAX_RESTORE_WORKERS, usable_cores()))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WorkerPool(Executor):
    """Up to ``max_workers`` named daemon threads, started on demand, ending when idle.

    Args:
        max_workers: the most threads running at once (>= 1).
        name: thread name prefix (threads are ``<name>_<n>``, as ``ThreadPoolExecutor``'s).
        idle_s: seconds a thread waits for work before it ends.
        nice: how much lower than the main thread's the threads' scheduling priority is
            (:func:`lower_priority`; 0: the same).

    Raises:
        ValueError: ``max_workers`` < 1 or ``idle_s`` <= 0.
    """

    def __init__(
        self, max_workers: int, name: str, *, idle_s: float = DEFAULT_IDLE_S, nice: int = 0
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.max_workers = max_workers
        self.name = name
        self.idle_s = idle_s
        self.nice = nice
        self._cv = threading.Condition()
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
        self._queue = deque()
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for work
        self._started = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker thread.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future[T] = Future()
        with self._cv:
            if self._shutdown:
                raise RuntimeError(f"cannot submit work to {self.name}: the pool was shut down")
            self._queue.append((future, fn, args, kwargs))
            if len(self._queue) > self._idle and len(self._threads) < self.max_workers:
                self._started += 1
                thread = _Worker(self, f"{self.name}_{self._started - 1}")
                self._threads.add(thread)
                thread.start()
            self._cv.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; the threads end once the queue is empty (at once when idle).

        With ``wait``, return when every thread has ended (work already submitted runs first,
        unless ``cancel_futures``)."""
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            self._cv.notify_all()
            threads = list(self._threads)
        if wait:
            current = threading.current_thread()
            for thread in threads:
                if thread is not current:
                    thread.join()

    def threads(self) -> list[threading.Thread]:
        """The worker threads alive now (none when the pool is idle past ``idle_s``)."""
        with self._cv:
            return list(self._threads)

    def _stop(self, thread: _Worker) -> None:
        with self._cv:
            thread.stopping = True
            self._cv.notify_all()
        if thread is not threading.current_thread():
            thread.join()

    def _work(self) -> None:
        me = threading.current_thread()
        assert isinstance(me, _Worker)
        lower_priority(self.nice)
        while True:
            with self._cv:
                while not self._queue:
                    if self._shutdown or me.stopping:
                        self._threads.discard(me)
                        return
                    self._idle += 1
                    try:
                        woken = self._cv.wait(self.idle_s)
                    finally:
                        self._idle -= 1
                    if not woken and not self._queue:
                        self._threads.discard(me)  # idle past the timeout: end
                        return
                future, fn, args, kwargs = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args, kwargs  # no reference to the work outlives it


class _Worker(threading.Thread):
    """A pool thread; :meth:`stop` ends it (the pool starts another when work comes)."""

    def __init__(self, pool: WorkerPool, name: str) -> None:
        super().__init__(target=pool._work, name=name, daemon=True)
        self._pool = pool
        self.stopping = False

    def stop(self) -> None:
        """End this thread once no work is queued (work already running finishes first), and
        wait for it."""
        self._pool._stop(self)
