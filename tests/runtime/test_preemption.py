"""The preemption mechanism on its own: real signals, the handler chain, the agreement, the
deadline warning, the SLURM requeue (a fake ``scontrol`` on PATH) and the cloud notice poller
(a real HTTP server on loopback)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.runtime.policy import preemption as pre


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter (a process of its own to end), its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_signal_asks_and_the_handler_before_it_still_runs() -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        p = pre.Preemption(pre.PreemptionConfig(signals=("SIGUSR2",))).install()
        assert not p.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not p.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.requested and p.request_ is not None
        assert p.request_.reason == "signal SIGUSR2" and p.request_.signum == signal.SIGUSR2
        assert seen == [signal.SIGUSR2], "the handler installed before must run too"
        p.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is not p._on_signal
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert seen == [signal.SIGUSR2, signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_default_signals_are_sigterm_sigint_and_slurms_requeue_signal() -> None:
    config = pre.PreemptionConfig()
    assert config.signal_numbers({}) == sorted([signal.SIGTERM, signal.SIGINT])
    slurm = config.signal_numbers({"SLURM_JOB_ID": "42"})
    assert slurm == sorted([signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
    assert pre.slurm_requeue_signal({"SLURM_JOB_ID": "42", "LI_SLURM_SIGNAL": "USR2"}) == (
        signal.SIGUSR2
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"signals": ("SIGNOPE",)}, "not a signal"),
        ({"grace_s": 0}, "grace_s"),
        ({"exit_code": 0}, "exit_code"),
        ({"exit_code": 300}, "exit_code"),
    ],
)
def test_config_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pre.PreemptionConfig(**kwargs)


def test_any_rank_asked_means_every_rank_stops() -> None:
    asked, other = pre.Preemption(), pre.Preemption()
    asked.request("signal SIGTERM")
    flags: list[bool] = []

    def all_reduce(flag: bool) -> bool:  # what the ranks' collective returns to each
        flags.append(flag)
        return True

    assert asked.agree(all_reduce) and other.agree(all_reduce)
    assert flags == [True, False]
    assert other.requested and other.request_ is not None
    assert other.request_.reason == "another rank was asked"
    assert not pre.Preemption().agree(lambda flag: flag)
    assert not pre.Preemption().agree()  # alone, nobody asked


def test_a_save_slower_than_the_grace_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    p = pre.Preemption(pre.PreemptionConfig(grace_s=2.0))
    with caplog.at_level(logging.WARNING, "lightning_incremental"):
        p.observe_save(0.5)
        assert "longer than the preemption grace" not in caplog.text
        p.observe_save(3.5)
        p.observe_save(4.0)
    assert caplog.text.count("longer than the preemption grace of 2.0s") == 1
    assert "takes 3.5s to commit" in caplog.text


def test_the_deadline_counts_from_the_request() -> None:
    now = [100.0]
    p = pre.Preemption(pre.PreemptionConfig(grace_s=25.0), clock=lambda: now[0])
    assert p.remaining() is None
    p.request("signal SIGTERM")
    now[0] = 110.0
    p.request("again")  # the first request's time is kept
    assert p.remaining() == pytest.approx(15.0)


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_repeated_deliveries_count_once_and_keep_the_first_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGUSR2 three times (SLURM signals every process, the agent forwards again): one
    request, timed at the first delivery, one grace timer; every delivery logged."""
    now = [100.0]
    p = pre.Preemption(
        pre.PreemptionConfig(signals=("SIGUSR2",), grace_s=25.0), clock=lambda: now[0]
    )
    before = signal.getsignal(signal.SIGUSR2)
    try:
        p.install()
        with caplog.at_level(logging.WARNING, logger="lightning_incremental"):
            os.kill(os.getpid(), signal.SIGUSR2)
            _wait_for(lambda: p._fallback is not None)
            timer = p._fallback
            for moment in (110.0, 120.0):
                now[0] = moment
                os.kill(os.getpid(), signal.SIGUSR2)
            _wait_for(lambda: "delivery 3" in caplog.text)
        assert p.deliveries == 3 and p._fallback is timer, "one grace, from the first signal"
        assert p.request_ is not None and p.request_.at == 100.0
        assert p.remaining() == pytest.approx(5.0)
        assert caplog.text.count("preemption requested (signal SIGUSR2)") == 1
        assert "SIGUSR2 received (delivery 2)" in caplog.text
        p.request("a cloud notice, later")
        assert p.request_.reason == "signal SIGUSR2"
        assert p.agree(lambda flag: flag) and p.agree(lambda flag: False), "the decision stands"
    finally:
        p.uninstall()
        signal.signal(signal.SIGUSR2, before)
    assert not [t for t in threading.enumerate() if t.name.startswith("li-preemption")]


def test_the_handler_takes_no_lock_and_starts_no_thread(tmp_path: Path) -> None:
    """A signal delivered while the main thread holds the request lock (another rank's request
    being recorded after the agreement) must not wait for it: the process reaches the step
    boundary at once (a handler that waited would hang until the timeout)."""
    code = (
        "import os, signal, threading\n"
        "from lightning_incremental.runtime.policy import preemption as pre\n"
        "p = pre.Preemption(pre.PreemptionConfig(signals=('SIGUSR2',))).install()\n"
        "threads = threading.active_count()\n"
        "with p._lock:\n"
        "    os.kill(os.getpid(), signal.SIGUSR2)\n"
        "    os.kill(os.getpid(), signal.SIGUSR2)\n"
        "    started = threading.active_count() - threads\n"
        "print('requested', p.requested, 'threads started in the handler', started)\n"
        "p.uninstall()\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "requested True threads started in the handler 0" in out.stdout


def test_a_frameworks_handler_is_chained_through_the_adapter() -> None:
    """``chain`` puts a safe stand-in where the framework's handler was: the handler calls the
    stand-in, never the original; once the last checkpoint committed, the signals are ignored
    until the process exits (a late one must not end it first)."""
    original: list[int] = []
    safe: list[int] = []

    def framework(signum: int, frame: object) -> None:
        original.append(signum)

    before = signal.signal(signal.SIGUSR2, framework)
    try:
        p = pre.Preemption(pre.PreemptionConfig(signals=("SIGUSR2",)))
        p.install(lambda signum, handler: lambda s, f: safe.append(s))
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: bool(safe))
        assert safe == [signal.SIGUSR2] and original == []
        assert p.agree()
        assert p.stay_until_exit() == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)
        assert safe == [signal.SIGUSR2] and original == []
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_installs_stacked_by_adapters_never_closed_stay_cheap_to_inspect() -> None:
    """A process that builds adapters and never closes them stacks installs. ``signal.getsignal``
    formats the installed handler's repr: it must name only the newest install, not every earlier
    one (twice each: 2**n to print), or the n-th install hangs while its memory grows. Only the
    newest acts (one thread in all); undone in order, each one below acts again."""
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    stack: list[pre.Preemption] = []
    try:
        lengths = []
        for _ in range(24):
            stack.append(pre.Preemption(pre.PreemptionConfig(signals=("SIGUSR2",))).install())
            lengths.append(len(repr(signal.getsignal(signal.SIGUSR2))))
        assert max(lengths) == min(lengths) < 500, lengths
        assert len(_watchers()) == 1, "one watcher thread, the newest install's"
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: stack[-1]._fallback is not None)
        assert [p.requested for p in stack] == [False] * 23 + [True]
        assert seen == [signal.SIGUSR2], "the user's handler runs once"
        assert stack[-1].agree()
        stack.pop().uninstall()
        assert signal.getsignal(signal.SIGUSR2) == stack[-1]._on_signal
        assert len(_watchers()) == 1, "the install below acts again"
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: stack[-1].requested)
        assert seen == [signal.SIGUSR2] * 2
    finally:
        for p in reversed(stack):
            p.uninstall()
        signal.signal(signal.SIGUSR2, before)
    assert not _watchers()


def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("li-preemption")]


def test_an_install_never_undone_does_not_end_the_process_under_a_newer_one() -> None:
    """An adapter never closed (a notebook, a sweep building Accelerator after Accelerator)
    leaves its install; a newer one is installed over it. A signal, the newer one agrees and
    takes its last checkpoint, longer than the grace (allowed once agreed): the older install
    must not start a grace of its own — no step boundary of its adapter will ever come, and
    its countdown would end the process with 128 + signum in the middle of that checkpoint."""
    code = (
        "import os, signal, threading, time\n"
        "from lightning_incremental.runtime.policy import preemption as pre\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))\n"
        "config = pre.PreemptionConfig(signals=('SIGUSR2',), grace_s=0.3)\n"
        "old = pre.Preemption(config).install()\n"
        "new = pre.Preemption(config).install()\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "assert new.agree()\n"
        "time.sleep(2.0)  # the last checkpoint, longer than the grace\n"
        "print('alive', len(seen), old.requested)\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "alive 1 False" in out.stdout


def test_a_delivery_before_a_newer_install_is_never_swallowed(tmp_path: Path) -> None:
    """A signal reaches the older install (its adapter done with) just before a newer one is
    installed: the newer one takes it over, timed at its delivery, and its grace runs."""
    code = (
        "import os, signal, time\n"
        "from lightning_incremental.runtime.policy import preemption as pre\n"
        "config = pre.PreemptionConfig(signals=('SIGUSR2',), grace_s=0.5)\n"
        "old = pre.Preemption(config).install()\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "at = old.request_.at\n"
        "new = pre.Preemption(config).install()\n"
        "print('inherited', new.requested and new.request_.at == at, flush=True)\n"
        "time.sleep(30)\n"
        "print('never ended')\n"
    )
    out = _python(code)
    assert out.returncode == 128 + signal.SIGUSR2, out.stdout + out.stderr
    assert "inherited True" in out.stdout and "never ended" not in out.stdout
    assert out.stderr.count("no step boundary was reached") == 1


def test_installs_undone_out_of_order_put_back_the_first_handler() -> None:
    """The older install undone first, then the newer: the handler from before both is back
    (not the older install's, which would record and swallow every later signal)."""

    def user(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGUSR2, user)
    try:
        config = pre.PreemptionConfig(signals=("SIGUSR2",))
        old = pre.Preemption(config).install()
        new = pre.Preemption(config).install()
        old.uninstall()
        assert signal.getsignal(signal.SIGUSR2) == new._on_signal
        new.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is user
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert not _watchers()


def test_no_grace_starts_once_the_install_is_undone() -> None:
    """The watcher may notice a delivery just after the install was undone (the wake-up and
    the uninstall race): no grace countdown may start then — it would end a process that has
    moved on. Deterministic: the watcher's step run by hand after the uninstall."""
    before = signal.getsignal(signal.SIGUSR2)
    p = pre.Preemption(pre.PreemptionConfig(signals=("SIGUSR2",), grace_s=0.2))
    try:
        p.install()
        p._deliveries.append((int(signal.SIGUSR2), time.monotonic()))
        p.uninstall()
        p._notice()
        assert p._fallback is None
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    calls = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_finish_requeues_on_rank_0_after_the_commit_and_exits(
    fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    p = pre.Preemption()
    p.request("signal SIGUSR1")
    with pytest.raises(SystemExit) as exited:
        p.finish(rank=1, requeue_default=True)
    assert exited.value.code == pre.EXIT_PREEMPTED
    assert not fake_scontrol.exists(), "only rank 0 requeues"
    with pytest.raises(SystemExit):
        p.finish(rank=0, requeue_default=True, committed="checkpoint step 15")
    assert fake_scontrol.read_text().split() == ["requeue", "4711"]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "9")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert pre.requeue_slurm_job()
    assert fake_scontrol.read_text().split()[-1] == "9_3"
    with pytest.raises(SystemExit):  # not asked to requeue: no call
        pre.Preemption(pre.PreemptionConfig(requeue=False)).finish(rank=0, requeue_default=True)
    assert fake_scontrol.read_text().count("requeue") == 2


class _Notice(http.server.BaseHTTPRequestHandler):
    body: bytes | None = None  # None: 404, as AWS answers while no stop is scheduled

    def do_GET(self) -> None:
        if type(self).body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(type(self).body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def notice_server() -> Iterator[tuple[str, type[_Notice]]]:
    handler = type("Notice", (_Notice,), {"body": None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/spot/instance-action", handler
    server.shutdown()


def test_the_cloud_notice_poller_turns_a_notice_into_a_request(
    notice_server: tuple[str, type[_Notice]],
) -> None:
    url, handler = notice_server
    p = pre.Preemption()
    poller = pre.MetadataPoller(p, url, interval_s=0.05, timeout_s=1.0)
    assert poller.poll() is None  # 404: no notice
    poller.start()
    time.sleep(0.2)
    assert not p.requested
    handler.body = json.dumps({"action": "terminate", "time": "2026-12-02T01:00:00Z"}).encode()
    deadline = time.monotonic() + 5
    while not p.requested and time.monotonic() < deadline:
        time.sleep(0.02)
    poller.stop()
    assert p.request_ is not None
    assert p.request_.reason == "cloud preemption notice: terminate at 2026-12-02T01:00:00Z"
    handler.body = b"TRUE"  # GCP's form
    assert pre.MetadataPoller(p, url).poll() == "the instance is being preempted"
    handler.body = b"FALSE"
    assert pre.MetadataPoller(p, url).poll() is None
    with pytest.raises(ConfigError, match="http"):
        pre.MetadataPoller(p, "ftp://nowhere")


def test_a_signal_no_boundary_follows_still_ends_the_process(tmp_path: Path) -> None:
    """A signal is never swallowed: a process that never reaches a step boundary ends with
    128 + SIGTERM once the grace has passed."""
    code = (
        "import os, signal, time\n"
        "from lightning_incremental.runtime.policy import preemption as pre\n"
        "p = pre.Preemption(pre.PreemptionConfig(grace_s=0.5)).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
        "print('never ended')\n"
    )
    start = time.monotonic()
    out = _python(code)
    assert out.returncode == 128 + signal.SIGTERM, out.stdout + out.stderr
    assert "no step boundary was reached within 0.5s" in out.stderr
    assert time.monotonic() - start < 20
