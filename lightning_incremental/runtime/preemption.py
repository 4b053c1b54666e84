"""Preemption with notice: a signal (or a call) asks for one last checkpoint, every rank agrees on
the step, the checkpoint commits, the process exits — the notice is used, no step is lost.

One mechanism for every adapter:

1. :meth:`Preemption.install` puts a handler on the configured signals (default SIGTERM, plus
   SLURM's requeue signal under SLURM). The handler only records the request — a signal handler
   runs between two bytecodes of the main thread, where nothing else is safe — and then calls the
   handler that was installed before it (a framework's, the user's), so nothing is taken away.
   :meth:`Preemption.request` is the same request from code: a cloud provider's notice (see
   :class:`MetadataPoller`), a maintenance event, the user's own handler.
2. At the next step boundary every rank calls :meth:`Preemption.agree` with the adapter's
   all-reduce: one small collective (or none, alone) says whether *any* rank was asked, so all
   ranks stop at the same step — torchrun forwards SIGTERM to every worker, but not at the same
   instant, and a cloud notice may reach one node only.
3. The adapter takes its checkpoint of that step on every rank and waits for the commit, then
   calls :meth:`Preemption.finish`: under SLURM auto-requeue rank 0 requeues the job (after the
   commit, never before), and the process exits with :data:`EXIT_PREEMPTED` (143, what a process
   ended by SIGTERM reports: a scheduler reads a preempted job as preempted, not as a success).

A signal is never swallowed: when no step boundary comes within ``grace_s`` of it (a loop the
adapter cannot see, a hang), the process ends with ``128 + signum``, as the signal would have.

The save must commit inside the grace the launcher leaves between SIGTERM and SIGKILL (torchrun
and Kubernetes: 30 s). :meth:`Preemption.observe_save` learns how long this run's saves take;
when the expected save time exceeds ``grace_s`` it warns once, naming both figures, while there
is still time to fix it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from lightning_incremental.core.errors import ConfigError

log = logging.getLogger("lightning_incremental")

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a process ended by SIGTERM reports
DEFAULT_GRACE_S = 25.0  # inside torchrun's and Kubernetes' 30 s between SIGTERM and SIGKILL

AWS_NOTICE = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCP_NOTICE = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"

Handler = Callable[[int, FrameType | None], Any] | int | None


def slurm_requeue_signal(environ: Mapping[str, str] | None = None) -> int | None:
    """SLURM's requeue signal for this job (``--signal=USR1@90``: SIGUSR1), when running under
    SLURM (``SLURM_JOB_ID``); None otherwise. ``LI_SLURM_SIGNAL`` names another one."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    return _signal_number(env.get("LI_SLURM_SIGNAL", "SIGUSR1"))


def _signal_number(name: str | int) -> int:
    if isinstance(name, int) and not isinstance(name, bool):
        return int(signal.Signals(name))
    if isinstance(name, str):
        key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        if key in signal.Signals.__members__:
            return int(signal.Signals[key])
    raise ConfigError(f"not a signal: {name!r} (e.g. 'SIGTERM', 'SIGUSR1' or a number)")


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """How a preemption notice is used.

    Attributes:
        enabled: handle preemption at all; False leaves every signal as it was.
        signals: the signals that ask for a last checkpoint (names or numbers); None: SIGTERM,
            plus SLURM's requeue signal under SLURM.
        grace_s: seconds the launcher leaves between the notice and SIGKILL; a run whose saves
            are expected to take longer is warned at its first save.
        exit_code: what the process exits with once the last checkpoint committed.
        requeue: under SLURM, requeue the job (``scontrol requeue``) after the commit; None:
            when the job was started with SLURM's auto-requeue (``SLURM_JOB_ID`` set and the
            adapter's cluster environment asks for it).
    """

    enabled: bool = True
    signals: tuple[str | int, ...] | None = None
    grace_s: float = DEFAULT_GRACE_S
    exit_code: int = EXIT_PREEMPTED
    requeue: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"preemption enabled must be True or False, got {self.enabled!r}")
        if self.signals is not None:
            for name in self.signals:
                _signal_number(name)
        grace = self.grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise ConfigError(f"grace_s must be a positive number of seconds, got {grace!r}")
        code = self.exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 0 < code < 256:
            raise ConfigError(f"exit_code must be an int in 1..255, got {code!r}")

    @classmethod
    def of(cls, value: object) -> PreemptionConfig:
        """An adapter's ``preemption`` argument as a config (True/False: the defaults, on/off).

        Raises:
            TypeError: neither a bool nor a :class:`PreemptionConfig`.
        """
        if isinstance(value, bool):
            return cls(enabled=value)
        if not isinstance(value, PreemptionConfig):
            raise TypeError(f"preemption must be a bool or a PreemptionConfig, got {value!r}")
        return value

    def signal_numbers(self, environ: Mapping[str, str] | None = None) -> list[int]:
        if self.signals is not None:
            return sorted({_signal_number(s) for s in self.signals})
        found = {int(signal.SIGTERM)}
        slurm = slurm_requeue_signal(environ)
        if slurm is not None:
            found.add(slurm)
        return sorted(found)


@dataclass
class Request:
    """A request for a last checkpoint: why, and when it arrived (monotonic seconds)."""

    reason: str
    at: float
    signum: int | None = None


@dataclass
class Preemption:
    """This process's preemption state: the request, the agreement, the exit.

    Args:
        config: what to handle and how.
        clock: monotonic seconds (injectable for tests).
    """

    config: PreemptionConfig = field(default_factory=PreemptionConfig)
    clock: Callable[[], float] = time.monotonic
    request_: Request | None = None
    agreed: bool = False
    _previous: dict[int, Handler] = field(default_factory=dict)
    _saves: list[float] = field(default_factory=list)
    _warned: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _fallback: threading.Timer | None = None

    # ---------------------------------------------------------------- the request

    def install(self) -> Preemption:
        """Handle the configured signals (main thread only: elsewhere it logs and does
        nothing, and :meth:`request` remains). Idempotent."""
        if not self.config.enabled or self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals are not handled: signal handlers can only be installed from "
                "the main thread (call preemption.request() from your own handler instead)"
            )
            return self
        for signum in self.config.signal_numbers():
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        previous, self._previous = self._previous, {}
        self._disarm()
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request(f"signal {signal.Signals(signum).name}", signum=signum)
        if self._fallback is None and not self.agreed:
            # Never swallow the signal: when no step boundary comes within the grace (a loop
            # the adapter cannot see, a hang), the signal's own action ends the process.
            self._fallback = threading.Timer(self.config.grace_s, self._default_action, (signum,))
            self._fallback.daemon = True
            self._fallback.start()
        previous = self._previous.get(signum)
        if callable(previous):  # a framework's or the user's handler: it runs too
            previous(signum, frame)

    def _default_action(self, signum: int) -> None:
        if self.agreed:
            return  # the last checkpoint is being taken: the launcher's SIGKILL decides
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
        timer, self._fallback = self._fallback, None
        if timer is not None:
            timer.cancel()

    def request(self, reason: str, *, signum: int | None = None) -> None:
        """Ask for a last checkpoint at the next step boundary (thread-safe, idempotent: the
        first request's time is the deadline's start)."""
        with self._lock:
            if self.request_ is None:
                self.request_ = Request(reason, self.clock(), signum)
                log.warning(
                    "preemption requested (%s): taking a last checkpoint at the next step "
                    "boundary, then exiting with code %d",
                    reason,
                    self.config.exit_code,
                )

    @property
    def requested(self) -> bool:
        """Whether this process was asked (not whether the ranks agreed)."""
        return self.request_ is not None

    def agree(self, any_rank: Callable[[bool], bool] | None = None) -> bool:
        """At a step boundary, on every rank: whether any rank was asked. ``any_rank`` is the
        adapter's all-reduce of a flag (max); None alone. Once true it stays true (and a signal
        no longer ends the process by itself after ``grace_s``: the checkpoint is being taken)."""
        if not self.agreed:
            mine = self.requested
            self.agreed = any_rank(mine) if any_rank is not None else mine
            if self.agreed and not mine:
                self.request("another rank was asked")
        return self.agreed

    # ---------------------------------------------------------------- the deadline

    def remaining(self) -> float | None:
        """Seconds left of the grace since the request, or None without one."""
        if self.request_ is None:
            return None
        return self.config.grace_s - (self.clock() - self.request_.at)

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

    def finish(self, *, rank: int, requeue_default: bool = False, committed: str = "") -> None:
        """The last checkpoint committed: requeue (rank 0, under SLURM, when asked) and exit
        with the configured code (``SystemExit``: exit handlers still run)."""
        requeue = self.config.requeue if self.config.requeue is not None else requeue_default
        if requeue and rank == 0:
            requeue_slurm_job()
        took = ""
        if self.request_ is not None:
            took = f" {self.clock() - self.request_.at:.1f}s after the request"
        log.warning(
            "preempted: %s committed%s; exiting with code %d",
            committed or "the last checkpoint",
            took,
            self.config.exit_code,
        )
        self.uninstall()
        raise SystemExit(self.config.exit_code)


def requeue_slurm_job(environ: Mapping[str, str] | None = None) -> bool:
    """``scontrol requeue`` this SLURM job (an array task by its array job and task id); whether
    it succeeded. Never raises: a failed requeue is logged, the checkpoint is committed anyway."""
    env = os.environ if environ is None else environ
    array = env.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{env.get('SLURM_ARRAY_TASK_ID')}" if array else env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job or ""):
        log.warning("not requeueing: no SLURM job id in the environment")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not requeue SLURM job %s: %s", job, exc)
        return False
    if result.returncode != 0:
        log.warning("scontrol requeue %s failed with exit code %d", job, result.returncode)
        return False
    log.info("requeued SLURM job %s", job)
    return True


class MetadataPoller:
    """Polls a cloud provider's preemption notice and turns it into a :meth:`Preemption.request`.

    Off by default (an HTTP request every ``interval_s`` on a daemon thread). ``provider``:
    ``"aws"`` (the spot ``instance-action`` document: 200 once a stop is scheduled), ``"gcp"``
    (``instance/preempted``: ``TRUE``), or a URL (tests, proxies) read the AWS way unless its
    body is ``TRUE``/``FALSE``. Every request has a timeout; errors other than "no notice"
    (404) are logged once and polling goes on.
    """

    def __init__(
        self,
        preemption: Preemption,
        provider: str = "aws",
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
    ) -> None:
        urls = {"aws": AWS_NOTICE, "gcp": GCP_NOTICE}
        self.url = urls.get(provider, provider)
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"preemption notice: 'aws', 'gcp' or an http(s) URL, got {provider!r}"
            )
        self.headers = {"Metadata-Flavor": "Google"} if provider == "gcp" else {}
        self.preemption, self.interval_s, self.timeout_s = preemption, interval_s, timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._complained = False

    def start(self) -> MetadataPoller:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="li-preemption-notice", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s + 1.0)

    def poll(self) -> str | None:
        """One look: the notice's text, or None when there is none."""
        request = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(65536).decode("utf-8", "replace").strip()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # AWS: no stop scheduled
                return None
            raise
        if body.upper() == "FALSE" or not body:
            return None
        if body.upper() == "TRUE":
            return "the instance is being preempted"
        try:
            doc = json.loads(body)
        except ValueError:
            return body[:200]
        if isinstance(doc, dict):
            return f"{doc.get('action', 'stop')} at {doc.get('time', 'soon')}"
        return body[:200]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.poll()
            except Exception as exc:  # unreachable metadata service: say so once, keep trying
                if not self._complained:
                    self._complained = True
                    log.warning("cannot read the preemption notice at %s: %s", self.url, exc)
                notice = None
            if notice is not None:
                self.preemption.request(f"cloud preemption notice: {notice}")
                return
            self._stop.wait(self.interval_s)


__all__ = [
    "DEFAULT_GRACE_S",
    "EXIT_PREEMPTED",
    "MetadataPoller",
    "Preemption",
    "PreemptionConfig",
    "requeue_slurm_job",
    "slurm_requeue_signal",
]
