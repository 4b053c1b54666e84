"""``accelerate launch ... -m accelerate_incremental [--dirpath URL | --config FILE] train.py``:
the launch module's flags, how it installs the integration, how it runs the script, and (slow)
real launches of an unmodified script (tests/jobs/plain_accelerate_job.py, which imports nothing of
ours) that are SIGKILLed mid-epoch and rerun with the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelerate_incremental
from accelerate_incremental import _launch, _tracking
from accelerate_incremental.trainer import hf_compat as _hf_compat
from lightning_incremental.core import CheckpointStore
from tests.accelerate_results import assert_identical
from tests.multiprocess.test_accelerate_launch import _free_port, _why

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "plain_accelerate_job.py"


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(accelerate_incremental.ENV_DIR, raising=False)
    monkeypatch.delenv(accelerate_incremental.ENV_CONFIG, raising=False)
    monkeypatch.setattr(Accelerator, "prepare", Accelerator.prepare)  # undoes install()
    # ... and its Trainer hook: the import hook, and what a hooked Trainer.__init__ runs
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_hf_compat, "_AFTER_INIT", [])
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ---------------------------------------------------------------------------- the flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dirpath", "yes", "{script}"], "--dirpath must be the checkpoint directory or URL"),
        (["--dirpath", "", "{script}"], "--dirpath must be the checkpoint directory or URL"),
        (["--dirpath", "{script}", "x"], "is a file: give the checkpoint directory or URL first"),
        (["{script}"], "no checkpoint store: give --dirpath URL or --config FILE"),
        (["--dirpath", "d"], "the following arguments are required: script"),
        (["--dirpath", "d", "missing.py"], "the training script 'missing.py' does not exist"),
        (["--dirpath", "d", "--config", "c.json", "{script}"], "not allowed with argument"),
        (["--config", "missing.json", "{script}"], "cannot read the config file"),
        (["--config", "{bad}", "{script}"], "unknown keys ['keep']"),
        (["--config", "{zero}", "{script}"], "keep_last must be >= 1, got 0"),
        (["--config", "{check}", "{script}"], "replica_check"),
        (["--dirp", "d", "{script}"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_with_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Every bad value ends the process before the script runs: status 2, the message names the
    flag or setting."""
    files = {"script": tmp_path / "train.py", "bad": tmp_path / "bad.json"}
    files["script"].write_text("raise SystemExit('the script ran')\n")
    files["bad"].write_text('{"dirpath": "d", "keep": 2}')
    contents: dict[str, dict[str, Any]] = {
        "zero": {"keep_last": 0},
        "check": {"replica_check": "fix"},
    }
    for name, content in contents.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"dirpath": "d", **content}))
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    with pytest.raises(SystemExit) as exited:
        _launch.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "usage: accelerate launch [accelerate options] -m accelerate_incremental" in err


def test_flag_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config = tmp_path / "inc.json"
    config.write_text(json.dumps({"dirpath": "s3://b/run", "keep_last": 2}))
    parsed = _launch.parse(["--config", str(config), str(script), "--dirpath", "a", "-m", "b"])
    expected = {"dirpath": "s3://b/run", "keep_last": 2}
    assert parsed == (expected, str(script), ["--dirpath", "a", "-m", "b"])
    monkeypatch.setenv(accelerate_incremental.ENV_DIR, "from-env")
    assert _launch.parse([str(script)])[0] == {"dirpath": "from-env"}
    assert _launch.parse(["--dirpath", "flag", str(script)])[0] == {"dirpath": "flag"}


# ---------------------------------------------------------------------------- installing


def test_installed_integration_enables_each_accelerator_once_it_prepares_a_model(
    tmp_path: Path,
) -> None:
    _launch.install({"dirpath": str(tmp_path / "s"), "keep_last": 2})
    acc = Accelerator(cpu=True)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    first = acc.prepare(DataLoader(data, batch_size=2, shuffle=True))
    assert getattr(acc, "_incremental_checkpointer", None) is None  # no model yet
    model = nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = accelerate_incremental.enable(acc)
    assert ckpt is not None and ckpt.store.config.keep_last == 2
    assert _tracking.is_tracked(first)
    second = acc.prepare(DataLoader(data, batch_size=4))
    assert _tracking.is_tracked(second)  # a later prepare's loaders are followed
    for x, y in first:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert acc.save_state() == ckpt.store.url
    assert ckpt.steps() == [0]
    with CheckpointStore(str(tmp_path / "s")) as store:
        loaders = store.load()["processes"][0]["loaders"]
    assert [p["epoch"] for p in loaders] == [1, 0]  # the tracked epoch of the first loader
    ckpt.close()


@pytest.mark.parametrize(
    ("launcher", "world", "refused"),
    [
        (["accelerate", "launch", "--num_processes", "2", "-m", "accelerate_incremental"], 1, True),
        (["python", "-m", "accelerate.commands.launch", "--num-processes=3", "x.py"], 1, True),
        (["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "x.py"], 2, False),
        (["accelerate", "launch", "--num_processes", "1", "x.py"], 1, False),
        (["accelerate", "launch", "x.py"], 1, False),
        (["bash", "run.sh", "--num_processes", "2"], 1, False),  # not accelerate's launcher
        ([], 1, False),
    ],
)
def test_a_launch_that_started_fewer_processes_than_asked_is_refused(
    launcher: list[str], world: int, refused: bool
) -> None:
    why = _launch.check_world(launcher, world)
    assert (why is not None) == refused
    if refused:
        assert "started one process" in why and "--multi_gpu" in why  # type: ignore[operator]


@pytest.mark.slow  # a launch of its own
def test_two_processes_asked_without_multi_gpu_on_cpu_stop_with_the_fix(tmp_path: Path) -> None:
    """Without GPUs, ``accelerate launch --num_processes 2`` starts one process: the flag stops
    it before the script runs, naming --multi_gpu, instead of training alone."""
    script = tmp_path / "train.py"
    script.write_text("print('TRAINED')\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "accelerate_incremental", "--dirpath", str(tmp_path), str(script)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode != 0 and "TRAINED" not in out.stdout, out.stdout + out.stderr
    assert "accelerate launch --num_processes 2 started one process" in out.stderr, out.stderr
    assert "--multi_gpu --num_processes 2 -m accelerate_incremental" in out.stderr


@pytest.mark.slow  # a Python process of its own
def test_module_runs_the_script_as_main(tmp_path: Path) -> None:
    """``python -m accelerate_incremental --dirpath D script.py ARGS`` (what ``accelerate
    launch -m`` runs in each process): the script sees its own argv, __file__, __name__ and
    directory on sys.path; its exit status and exceptions are its own."""
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import json, sys\n"
        "print(json.dumps({'argv': sys.argv, 'file': __file__, 'name': __name__,"
        " 'path0': sys.path[0]}))\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('from the script')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(accelerate_incremental.ENV_DIR, None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "accelerate_incremental", "--dirpath", str(tmp_path / "s")]
        cmd += [str(script), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    out = run("5", "--flag", "-m", "x")
    assert out.returncode == 5, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {
        "argv": [str(script), "5", "--flag", "-m", "x"],
        "file": str(script),
        "name": "__main__",
        "path0": str(script.parent),
    }
    failed = run("raise")
    assert failed.returncode == 1
    assert "ValueError: from the script" in failed.stderr


def test_a_gloo_group_the_script_left_is_destroyed_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left to interpreter teardown, gloo's threads can abort a process that finished (exit 134:
    a failed launch); the module registers, before the script runs, an exit hook that destroys
    a gloo group while the interpreter is whole."""
    import atexit

    import torch.distributed as dist

    registered: list[Any] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(_launch, "install", lambda config: None)
    script = tmp_path / "train.py"
    script.write_text(
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method={(tmp_path / 'rdv').as_uri()!r}, rank=0,"
        " world_size=1)\n"
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        _launch.main(["--dirpath", str(tmp_path / "s"), str(script)])
        assert dist.is_initialized()
        assert registered == [_launch.end_gloo_group]
        registered[0]()
        assert not dist.is_initialized()
        registered[0]()  # nothing left: nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- real launches


def launch(
    store: Path, out: Path, processes: int, *script_args: str
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        *(["--multi_gpu"] if processes > 1 else []),
        "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "accelerate_incremental", "--dirpath", str(store),
        str(JOB), "--out", str(out), *script_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_INCREMENTAL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def finished(store: Path, out: Path, processes: int, *script_args: str) -> dict[str, Any]:
    done = launch(store, out, processes, *script_args)
    assert done.returncode == 0, _why(done) + done.stderr[-3000:]
    assert done.stdout.count("JOB DONE") == processes, done.stdout[-2000:]
    result: dict[str, Any] = torch.load(out, weights_only=False)
    result["stdout"] = done.stdout
    return result


def interrupted_then_resumed(
    tmp_path: Path, processes: int, crash_after: int, *script_args: str
) -> dict[str, Any]:
    """SIGKILLed right after the save of step ``crash_after``, then the same command again."""
    store, out = tmp_path / "store", tmp_path / "out.pt"
    killed = launch(store, out, processes, "--crash-after", str(crash_after), *script_args)
    assert killed.returncode != 0, "the interrupted run should have died"
    assert not out.exists()
    return finished(store, out, processes, *script_args)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two processes, uninterrupted (each takes 5 batches per epoch: 15 steps)."""
    tmp = tmp_path_factory.mktemp("two")
    result = finished(tmp / "store", tmp / "out.pt", 2)
    assert result["step"] == 15
    return result


@pytest.fixture(scope="module")
def reference_one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, uninterrupted (10 batches per epoch: 30 steps)."""
    tmp = tmp_path_factory.mktemp("one")
    result = finished(tmp / "store", tmp / "out.pt", 1)
    assert result["step"] == 30
    return result


@pytest.mark.slow
def test_two_processes_killed_mid_epoch_resume_bit_identical(
    tmp_path: Path, reference_two: dict[str, Any]
) -> None:
    """Killed after step 7 (the newest checkpoint: step 6, one batch into epoch 1) and rerun
    with the same command, both processes continue from epoch 1's second batch."""
    resumed = interrupted_then_resumed(tmp_path, 2, 7)
    assert "starting at global step 6" in resumed["stdout"]
    assert_identical(reference_two, resumed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("crash_after", "every", "restored"),
    [(7, 3, 6), (12, 5, 10)],
    ids=["mid-epoch", "at-an-epochs-last-batch"],
)
def test_one_process_killed_resumes_bit_identical(
    tmp_path: Path, reference_one: dict[str, Any], crash_after: int, every: int, restored: int
) -> None:
    resumed = interrupted_then_resumed(tmp_path, 1, crash_after, "--every", str(every))
    assert f"starting at global step {restored}" in resumed["stdout"]
    assert_identical(reference_one, resumed)
