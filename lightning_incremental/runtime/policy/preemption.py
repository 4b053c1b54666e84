"""Preemption with notice: a signal (or a call) asks for one last checkpoint, every rank agrees on
the step, the checkpoint commits, the process exits — the notice is used, no step is lost.

One mechanism for every adapter:

1. :meth:`Preemption.install` puts a handler on the configured signals (default SIGTERM and
   SIGINT, plus SLURM's requeue signal under SLURM). :meth:`Preemption.request` is the same
   request from code: a cloud provider's notice (see :class:`MetadataPoller`), a maintenance
   event, the user's own handler.
2. At the next step boundary every rank calls :meth:`Preemption.agree` with the adapter's
   all-reduce: one small collective (or none, alone) says whether *any* rank was asked, so all
   ranks stop at the same step — torchrun forwards SIGTERM to every worker, but not at the same
   instant, and a cloud notice may reach one node only.
3. The adapter takes its checkpoint of that step on every rank and waits for the commit, then
   calls :meth:`Preemption.finish`: under SLURM auto-requeue rank 0 requeues the job (after the
   commit, never before), and the process exits with :data:`EXIT_PREEMPTED` (143, what a process
   ended by SIGTERM reports: a scheduler reads a preempted job as preempted, not as a success).

Signal handlers. A handler runs between two bytecodes of the main thread, which may be inside a
collective, a save, or a lock of ours. Ours only appends the delivery to a list (no lock) and
wakes a named daemon thread (one byte down a non-blocking pipe), which logs it and starts the
grace's countdown; then it calls the handler installed before it, so nothing is taken away —
but a framework's handler passes through the adapter first (``install(chain=...)``), which
keeps what it records and drops what it would do in the handler: a collective (Lightning's
SIGTERM notifier broadcasts under DDP), a checkpoint (Lightning's SLURM requeue handler), a
thread (the Trainer's JIT checkpoint); the adapter does those at the step boundary. Python's
``KeyboardInterrupt`` for SIGINT is the signal's default action, not chained.

Signals delivered more than once — SLURM signals every process of a job step, the ``torchrun``
agent forwards SIGTERM again, a wrapper once more — count once: every delivery is recorded and
logged, the decision is made at the next step boundary by all ranks together, and the grace
counts from the first delivery, so a later one never shortens it or changes the decision (who
wants the process ended now sends SIGKILL). One that arrives during the agreement's all-reduce
counts at the next boundary.

A signal is never swallowed: when no step boundary comes within ``grace_s`` of it (a loop the
adapter cannot see, a hang), the process ends with ``128 + signum``, as the signal would have.

The save must commit inside the grace the launcher leaves between SIGTERM and SIGKILL (torchrun
and Kubernetes: 30 s). :meth:`Preemption.observe_save` learns how long this run's saves take;
when the expected save time exceeds ``grace_s`` it warns once, naming both figures, while there
is still time to fix it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from lightning_incremental.runtime.policy.preemption_config import (
    DEFAULT_GRACE_S,
    EXIT_PREEMPTED,
    PreemptionConfig,
    slurm_requeue_signal,
)
from lightning_incremental.runtime.policy.preemption_notice import (
    AWS_NOTICE,
    GCP_NOTICE,
    MetadataPoller,
)
from lightning_incremental.runtime.policy.preemption_os import _Watcher, requeue_slurm_job

log = logging.getLogger("lightning_incremental")

Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass
class Request:
    """A request for a last checkpoint: why, and when it arrived (monotonic seconds)."""

    reason: str
    at: float
    signum: int | None = None


@dataclass(repr=False)
class Preemption:
    """This process's preemption state: the request, the agreement, the exit.

    Args:
        config: what to handle and how.
        clock: monotonic seconds (injectable for tests).
    """

    # The repr names this object only. Its bound handler is what ``signal.getsignal`` returns,
    # and Python's ``getsignal`` formats the handler's repr; a dataclass repr would include the
    # handlers installed before it (twice: previous and chained), so a stack of n installs
    # would cost 2**n to print — every ``getsignal`` of a later install would hang.
    def __repr__(self) -> str:
        signums = sorted(self._previous)
        names = [signal.Signals(s).name for s in signums]
        return (
            f"Preemption(signals={names}, deliveries={len(self._deliveries)}, "
            f"requested={self._request is not None}, agreed={self.agreed})"
        )

    config: PreemptionConfig = field(default_factory=PreemptionConfig)
    clock: Callable[[], float] = time.monotonic
    agreed: bool = False
    _request: Request | None = None  # the first request from code (under _lock)
    # (signum, monotonic time) of every delivery, appended by the handler only (an append is
    # atomic: the handler takes no lock, the main thread it interrupts may hold any)
    _deliveries: list[tuple[int, float]] = field(default_factory=list)
    _noticed: int = 0  # deliveries the watcher has logged
    _previous: dict[int, Handler] = field(default_factory=dict)
    _chained: dict[int, Handler] = field(default_factory=dict)
    _watcher: _Watcher | None = None
    _saves: list[float] = field(default_factory=list)
    _warned: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _fallback: threading.Timer | None = None
    _armed: bool = False  # whether the grace may start (under _lock): installed, not stood by
    _put_back: dict[int, Handler] = field(default_factory=dict)  # undone out of order

    # ---------------------------------------------------------------- the request

    def install(self, chain: Callable[[int, Handler], Handler] | None = None) -> Preemption:
        """Handle the configured signals (main thread only: elsewhere it logs and does
        nothing, and :meth:`request` remains). Idempotent.

        ``chain(signum, handler)``: what the handler calls in place of ``handler``, the one
        installed before it (None: that handler itself). An adapter passes its framework's
        handler through it, so that the chained call does no collective and no blocking call
        (see the module's notes on handlers).
        """
        if not self.config.enabled or self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals are not handled: signal handlers can only be installed from "
                "the main thread (call preemption.request() from your own handler instead)"
            )
            return self
        self._armed = True
        self._watcher = _Watcher(self._notice)
        belows: dict[int, Preemption] = {}
        for signum in self.config.signal_numbers():
            previous = signal.getsignal(signum)
            self._previous[signum] = previous
            below = _installed(previous)
            if below is not None:
                # An install of ours is in effect (an adapter never closed: a notebook, a sweep
                # that builds Accelerator after Accelerator). The newest acts alone; the one
                # below stands by until this one puts its handler back. Chaining to it would
                # start a second grace whose step boundary never comes — it would end the
                # process during this install's last checkpoint — and would keep a thread per
                # install. Its own chain (the user's handler, made safe by its adapter) is ours.
                self._chained[signum] = below._chained.get(signum)
                belows[id(below)] = below
            else:
                self._chained[signum] = chain(signum, previous) if chain is not None else previous
            signal.signal(signum, self._on_signal)
        for below in belows.values():
            self._inherit(below)
        if self._deliveries:
            self._watcher.wake()
        return self

    def _inherit(self, below: Preemption) -> None:
        """Stand the install below by; a delivery it has not acted on (no agreement yet)
        becomes this one's, with its time: a signal is never swallowed. (Main thread, after
        this install's handlers are in place: the handler appends while this runs, so the
        merged list replaces the part read, in one slice assignment.)"""
        below._stop_threads()
        if below.agreed or not below._deliveries:
            return
        mine = list(self._deliveries)
        merged = sorted([*below._deliveries, *mine], key=lambda delivery: delivery[1])
        self._deliveries[: len(mine)] = merged

    def _stand_in(self) -> None:
        """Put back as the installed handler (the install above was undone): act again."""
        if self._previous and self._watcher is None:
            with self._lock:
                self._armed = True
            self._watcher = _Watcher(self._notice)
            if len(self._deliveries) > self._noticed:
                self._watcher.wake()

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install` (an install of ours
        below this one acts again; one that was itself undone meanwhile is passed over, to
        what it had put back)."""
        previous, self._previous = self._previous, {}
        self._chained = {}
        self._stop_threads()
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in previous.items():
            if signal.getsignal(signum) != self._on_signal:
                # Undone out of order: an install above chains past this one and puts back
                # what this one would have (see _put_back).
                self._put_back[signum] = handler
                continue
            below, undone = _installed(handler), _ours(handler)
            while below is None and undone is not None:
                handler = undone._put_back.get(signum, signal.SIG_DFL)
                below, undone = _installed(handler), _ours(handler)
            if below is not None:
                below._stand_in()
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def stay_until_exit(self) -> list[int]:
        """The last checkpoint committed and the process is on its way out with the configured
        code: from now on the handled signals are ignored, so that one delivered late (the
        agent forwarding again, SLURM signalling every process) does not end the process first
        and turn its exit into a death by signal — SIGKILL still ends it. The handlers from
        before :meth:`install` are not put back. Returns the signals now ignored."""
        signums = list(self._previous)
        self._previous, self._chained = {}, {}
        self._stop_threads()
        if threading.current_thread() is threading.main_thread():
            for signum in signums:
                signal.signal(signum, signal.SIG_IGN)
        return signums

    def _stop_threads(self) -> None:
        with self._lock:
            self._armed = False
        self._disarm()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the main thread, which may be inside a
        # collective, a save or a lock of ours: record, wake the watcher, chain — nothing that
        # takes a lock, waits, or talks to another process.
        self._deliveries.append((signum, self.clock()))
        watcher = self._watcher
        if watcher is not None:
            watcher.wake()
        chained = self._chained.get(signum)
        if callable(chained) and chained is not signal.default_int_handler:
            chained(signum, frame)  # a framework's (made safe by the adapter) or the user's

    def _notice(self) -> None:
        """On the watcher thread: log the new deliveries; at the first, start the grace."""
        deliveries = list(self._deliveries)
        for index in range(self._noticed, len(deliveries)):
            name = signal.Signals(deliveries[index][0]).name
            if index == 0 and self._request is None:
                self._log_request(f"signal {name}")
            else:
                log.warning(
                    "preemption: %s received (delivery %d); the decision stands and its grace "
                    "still counts from the first request",
                    name,
                    index + 1,
                )
        self._noticed = len(deliveries)
        with self._lock:  # against _stop_threads: no grace starts once disarmed
            if not deliveries or self._fallback is not None or self.agreed or not self._armed:
                return
            # Never swallow the signal: when no step boundary comes within the grace (a loop
            # the adapter cannot see, a hang), the signal's own action ends the process.
            signum, at = deliveries[0]
            left = max(0.0, self.config.grace_s - (self.clock() - at))
            self._fallback = threading.Timer(left, self._default_action, (signum,))
            self._fallback.name = "li-preemption-grace"
            self._fallback.daemon = True
            self._fallback.start()

    def _default_action(self, signum: int) -> None:
        with self._lock:
            if self.agreed or not self._armed:
                return  # the last checkpoint is being taken (the launcher's SIGKILL decides),
                # or this install was undone or stood by
        log.error(
            "preemption: no step boundary was reached within %.1fs of %s; ending the process "
            "with code %d, as the signal would have (no last checkpoint)",
            self.config.grace_s,
            signal.Signals(signum).name,
            128 + signum,
        )
        logging.shutdown()
        os._exit(128 + signum)  # from a thread: a handler cannot be reset here

    def _disarm(self) -> None:
        with self._lock:
            timer, self._fallback = self._fallback, None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                # Cancelled, the thread ends at once: wait for it, so that an undone install
                # leaves no thread behind (one that already fired is acting: not waited long).
                timer.join(1.0)

    def _log_request(self, reason: str) -> None:
        log.warning(
            "preemption requested (%s): taking a last checkpoint at the next step boundary, "
            "then exiting with code %d",
            reason,
            self.config.exit_code,
        )

    def request(self, reason: str, *, signum: int | None = None) -> None:
        """Ask for a last checkpoint at the next step boundary (thread-safe, idempotent: the
        first request's time is the deadline's start). Not for a signal handler: a handler
        installed by :meth:`install` records a delivery without any lock."""
        with self._lock:
            if self._request is None:
                self._request = Request(reason, self.clock(), signum)
                if not self._deliveries:
                    self._log_request(reason)

    @property
    def request_(self) -> Request | None:
        """The first request: the earlier of the first signal and the first call of
        :meth:`request` (None: none yet)."""
        deliveries, asked = self._deliveries, self._request
        if deliveries:
            signum, at = deliveries[0]
            if asked is None or at <= asked.at:
                return Request(f"signal {signal.Signals(signum).name}", at, signum)
        return asked

    @property
    def requested(self) -> bool:
        """Whether this process was asked (not whether the ranks agreed)."""
        return bool(self._deliveries) or self._request is not None

    @property
    def deliveries(self) -> int:
        """How many handled signals this process received."""
        return len(self._deliveries)

    def agree(self, any_rank: Callable[[bool], bool] | None = None) -> bool:
        """At a step boundary, on every rank: whether any rank was asked. ``any_rank`` is the
        adapter's all-reduce of a flag (max); None alone. Once true it stays true (and a signal
        no longer ends the process by itself after ``grace_s``: the checkpoint is being taken);
        a signal that arrives during the all-reduce counts at the next boundary."""
        if not self.agreed:
            mine = self.requested
            self.agreed = any_rank(mine) if any_rank is not None else mine
            if self.agreed and not mine:
                self.request("another rank was asked")
        return self.agreed

    # ---------------------------------------------------------------- the deadline

    def remaining(self) -> float | None:
        """Seconds left of the grace since the first request, or None without one."""
        first = self.request_
        if first is None:
            return None
        return self.config.grace_s - (self.clock() - first.at)

    def observe_save(self, seconds: float) -> None:
        """A save of this run took ``seconds`` from its start to its commit; warn once when the
        expected save time (the slowest of the last few) is longer than the grace."""
        self._saves = [*self._saves[-4:], seconds]
        expected = max(self._saves)
        if not self._warned and expected > self.config.grace_s:
            self._warned = True
            log.warning(
                "a save of this run takes %.1fs to commit, longer than the preemption grace of "
                "%.1fs: a checkpoint taken at a preemption notice may not commit before the "
                "process is killed. Raise grace_s to what your launcher allows (and its own "
                "grace, e.g. Kubernetes' terminationGracePeriodSeconds, SLURM --signal=USR1@T), "
                "or make saves cheaper.",
                expected,
                self.config.grace_s,
            )

    # ---------------------------------------------------------------- the exit

    def requeue(self, *, rank: int, requeue_default: bool = False) -> None:
        """Requeue the SLURM job (rank 0; when the config or ``requeue_default`` asks): call it
        once the last checkpoint committed, never before."""
        requeue = self.config.requeue if self.config.requeue is not None else requeue_default
        if requeue and rank == 0:
            requeue_slurm_job()

    def finish(self, *, rank: int, requeue_default: bool = False, committed: str = "") -> None:
        """The last checkpoint committed: requeue (rank 0, under SLURM, when asked) and exit
        with the configured code (``SystemExit``: exit handlers still run; the handled signals
        are ignored until then, see :meth:`stay_until_exit`)."""
        self.requeue(rank=rank, requeue_default=requeue_default)
        took = ""
        first = self.request_
        if first is not None:
            took = f" {self.clock() - first.at:.1f}s after the request"
        log.warning(
            "preempted: %s committed%s; exiting with code %d",
            committed or "the last checkpoint",
            took,
            self.config.exit_code,
        )
        self.stay_until_exit()
        raise SystemExit(self.config.exit_code)


def _ours(handler: Handler) -> Preemption | None:
    """The :class:`Preemption` whose handler this is, or None."""
    owner = getattr(handler, "__self__", None)
    ours = getattr(handler, "__func__", None) is Preemption._on_signal
    return owner if ours and isinstance(owner, Preemption) else None


def _installed(handler: Handler) -> Preemption | None:
    """The :class:`Preemption` whose handler this is, while it is installed, or None."""
    owner = _ours(handler)
    return owner if owner is not None and owner._previous else None


__all__ = [
    "AWS_NOTICE",
    "DEFAULT_GRACE_S",
    "GCP_NOTICE",
    "EXIT_PREEMPTED",
    "MetadataPoller",
    "Preemption",
    "PreemptionConfig",
    "requeue_slurm_job",
    "slurm_requeue_signal",
]
