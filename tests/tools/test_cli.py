"""The ``lightning-incremental`` command on healthy and corrupted stores."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_incremental.cli import main
from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import open_storage
from tests.conftest import assert_state_equal, backend_url
from tests.faulty import FaultyStorage


def lightning_like(seed: int) -> dict:
    """A Lightning-shaped state whose weights change in a few rows with ``seed`` (deltas win)."""
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    weight[: seed // 10] += 1.0
    return {
        "state_dict": {
            "layer.weight": weight,
            "layer.bias": torch.zeros(64),
            "steps": torch.tensor(seed),
        },
        "epoch": seed,
        "global_step": seed * 10,
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
    }


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with CheckpointStore(str(root), chunk_size=4096, pack_size=8192) as store:
        for step in (10, 20, 30):
            store.save(lightning_like(step), step, metadata={"loss": 1.0 / step}).wait()
    return root


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, object]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def corrupt_newest(root: Path) -> str:
    doc = json.loads((root / mf.manifest_path(30)).read_bytes())
    older = json.loads((root / mf.manifest_path(20)).read_bytes())["packs"]
    pack = next(p for p in doc["packs"] if p not in older)
    data = bytearray((root / pack).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / pack).write_bytes(bytes(data))
    return pack


def test_ls(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(capsys, "ls", str(store_dir))
    assert code == 0
    rows = doc["checkpoints"]  # type: ignore[index]
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert rows[0]["full_base"] and rows[0]["chain_depth"] == 0
    assert all(r["bytes_logical"] > 0 and r["world_size"] == 1 for r in rows)


def test_inspect_shows_changes_and_audit(store_dir: Path, capsys) -> None:
    code, doc = run_json(capsys, "inspect", str(store_dir), "20")
    assert code == 0
    assert doc["step"] == 20 and doc["parent"] == 10
    assert doc["audit"]["metadata"] == {"loss": 0.05}
    changed = {t["path"]: t["changed"] for t in doc["tensors"]}
    assert changed["state['state_dict']['layer.weight']"] is True
    assert changed["state['state_dict']['layer.bias']"] is False


def test_verify_healthy_and_corrupt(store_dir: Path, capsys) -> None:
    code, doc = run_json(capsys, "verify", str(store_dir), "--all")
    assert code == 0 and all(r["ok"] for r in doc["checkpoints"])
    pack = corrupt_newest(store_dir)
    code, doc = run_json(capsys, "verify", str(store_dir))
    assert code == 1
    (report,) = doc["checkpoints"]
    assert report["step"] == 30 and not report["ok"]
    assert any(pack in e for e in report["errors"])
    code, doc = run_json(capsys, "verify", str(store_dir), "20")
    assert code == 0


def test_verify_says_a_checkpoint_could_not_be_read(
    store_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the manifest fails (an I/O error, as a flaky mount or network gives): that is not
    corruption. The report says it could not be read, with the storage's error, and the exit
    code is the storage error's; the checkpoint is not quarantined and loads once reads work."""
    from lightning_incremental.core.storage import local

    manifest = os.path.join(str(store_dir), *mf.manifest_path(30).split("/"))

    def failing_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(file) == manifest:
            raise OSError(errno.EIO, os.strerror(errno.EIO), manifest)
        return open(file, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(local, "open", failing_open, raising=False)
        code, doc = run_json(capsys, "verify", str(store_dir))
        assert code == 4
        (report,) = doc["checkpoints"]
        assert report["step"] == 30 and not report["ok"] and report["errors"] == []
        assert "Input/output error" in report["unreadable"]
        assert mf.manifest_path(30) in report["unreadable"]
        assert main(["verify", str(store_dir)]) == 4
        out = capsys.readouterr().out
        assert "UNREADABLE" in out and "could not be read" in out and "CORRUPT" not in out
        with CheckpointStore(str(store_dir)) as store:
            result = store.verify()
            assert result.unreadable and not result.damaged and not result.ok
            patched.undo()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback past a quarantined step
                assert_state_equal(store.load(), lightning_like(30))
    code, doc = run_json(capsys, "verify", str(store_dir))
    assert code == 0 and doc["checkpoints"][0]["unreadable"] is None


def test_diff(store_dir: Path, capsys) -> None:
    code, doc = run_json(capsys, "diff", str(store_dir), "10", "30")
    assert code == 0
    paths = {r["path"]: r["change"] for r in doc["tensors"]}
    assert paths["state['state_dict']['layer.weight']"] == "changed"
    assert "state['state_dict']['layer.bias']" not in paths
    assert doc["plain_values_equal"] is False


@pytest.mark.parametrize("fmt", ["torch", "lightning", "safetensors"])
def test_export_round_trips(store_dir: Path, tmp_path: Path, capsys, fmt: str) -> None:
    target = tmp_path / f"out.{fmt}"
    code, doc = run_json(
        capsys, "export", str(store_dir), "20", "--to", str(target), "--format", fmt
    )
    assert code == 0 and doc["step"] == 20 and target.stat().st_size == doc["bytes"]
    expected = CheckpointStore(str(store_dir)).load(20)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        loaded = load_file(str(target))
        assert set(loaded) == {
            "state_dict.layer.weight",
            "state_dict.layer.bias",
            "state_dict.steps",
        }
        for key, tensor in expected["state_dict"].items():
            assert_state_equal(loaded[f"state_dict.{key}"], tensor)
    else:
        assert_state_equal(torch.load(target, weights_only=True), expected)


@pytest.mark.parametrize(
    ("state", "paths"),
    [
        ({0: torch.ones(2), "0": torch.zeros(3)}, ("state[0]", "state['0']")),
        (
            {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}},
            ("state['a.b']", "state['a']['b']"),
        ),
        ({"l": [torch.ones(1)], "l.0": torch.ones(1)}, ("state['l'][0]", "state['l.0']")),
    ],
)
def test_export_safetensors_refuses_names_that_collide(
    tmp_path: Path, capsys, state: dict, paths: tuple[str, str]
) -> None:
    """Two tensors whose dotted names are one: refused with both key paths, nothing written
    (a safetensors file holds one tensor per name: one of them would be dropped)."""
    with CheckpointStore(str(tmp_path / "s")) as store:
        store.save(state, 1).wait()
    target = tmp_path / "out.safetensors"
    argv = ["export", str(tmp_path / "s"), "--to", str(target), "--format", "safetensors"]
    assert main(argv) == 4
    err = " ".join(capsys.readouterr().err.split())
    assert all(path in err for path in paths), err
    assert "--format torch" in err
    assert not target.exists() and list(tmp_path.glob(".out.safetensors*")) == []
    assert main([*argv[:-1], "torch"]) == 0  # torch.save keeps both


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")  # the second export
def test_export_dcp_counts_only_what_it_wrote(tmp_path: Path, store_dir: Path, capsys) -> None:
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "unrelated.bin").write_bytes(b"x" * 1_000_000)
    code, doc = run_json(capsys, "export", str(store_dir), "--format", "dcp", "--to", str(out))
    assert code == 0
    written = sum(f.stat().st_size for f in out.rglob("*") if f.name != "unrelated.bin")
    assert 0 < doc["bytes"] == written
    code, again = run_json(capsys, "export", str(store_dir), "--format", "dcp", "--to", str(out))
    assert code == 0 and again["bytes"] == written  # the same files, written again


def test_export_lightning_needs_a_lightning_checkpoint(tmp_path: Path, capsys) -> None:
    with CheckpointStore(str(tmp_path / "s")) as store:
        store.save({"w": torch.ones(2)}, 1).wait()
    assert (
        main(["export", str(tmp_path / "s"), "--to", str(tmp_path / "x"), "--format", "lightning"])
        == 2
    )
    assert "not a Lightning checkpoint" in capsys.readouterr().err


def test_compact_then_gc(store_dir: Path, capsys) -> None:
    code, doc = run_json(capsys, "compact", str(store_dir))
    assert code == 0 and doc["compacted"] and doc["step"] == 30, doc
    code, doc = run_json(capsys, "gc", str(store_dir), "--keep-last", "1", "--grace", "0")
    assert code == 0 and doc["removed_steps"] == [10, 20]
    assert doc["removed_objects"] == 0, "objects younger than the minimum age stay"
    code, doc = run_json(capsys, "gc", str(store_dir), "--grace", "0", "--min-age", "0")
    assert code == 0 and doc["removed_objects"] > 0
    assert_state_equal(CheckpointStore(str(store_dir)).load(), lightning_like(30))
    code, doc = run_json(capsys, "gc", str(store_dir), "--dry-run")
    assert code == 0 and doc["dry_run"] and doc["removed_objects"] == 0


def test_errors_and_exit_codes(tmp_path: Path, store_dir: Path, capsys) -> None:
    assert main(["ls", str(tmp_path / "missing")]) == 3
    assert "no checkpoint store" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("x")
    assert main(["verify", str(tmp_path / "plain")]) == 3
    assert "not a lightning-incremental checkpoint store" in capsys.readouterr().err
    assert main(["inspect", str(store_dir), "25"]) == 3
    assert "committed steps: 10, 20, 30" in capsys.readouterr().err
    assert main(["ls", "nosuchproto://x"]) == 2
    assert main(["ls", str(store_dir), "--storage-option", "novalue"]) == 2
    assert main(["verify", str(store_dir), "10", "--all"]) == 2
    with pytest.raises(SystemExit) as exited:
        main(["frobnicate", str(store_dir)])
    assert exited.value.code == 2


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "lightning_incremental.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.mark.slow  # a Python process of its own
def test_the_command_in_a_subprocess(store_dir: Path, tmp_path: Path) -> None:
    listed = _cli("ls", str(store_dir))
    assert listed.returncode == 0 and "30" in listed.stdout
    assert "\x1b[" not in listed.stdout, "no terminal: no colour codes"
    verified = _cli("verify", str(store_dir), "--all", "--json")
    assert verified.returncode == 0
    assert [r["step"] for r in json.loads(verified.stdout)["checkpoints"]] == [10, 20, 30]
    corrupt_newest(store_dir)
    broken = _cli("verify", str(store_dir))
    assert broken.returncode == 1 and "CORRUPT" in broken.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["inspect", "{store}"], 0),
        (["diff", "{store}", "10", "20"], 0),
        (["export", "{store}", "--to", "{tmp}/x.pt"], 0),
        (["compact", "{store}"], 0),
        (["gc", "{store}", "--keep-last", "2"], 0),
        (["ls", "{tmp}/missing"], 3),
    ],
)
def test_every_command_in_a_subprocess(store_dir: Path, tmp_path: Path, argv, code) -> None:
    result = _cli(*(a.format(store=store_dir, tmp=tmp_path) for a in argv))
    assert result.returncode == code, result.stdout + result.stderr


def test_export_keys_reads_and_writes_only_those_keys(store_dir: Path, tmp_path: Path, capsys):
    target = tmp_path / "weights.safetensors"
    code, doc = run_json(
        capsys,
        "export",
        str(store_dir),
        "--to",
        str(target),
        "--format",
        "safetensors",
        "--keys",
        "state_dict",
    )
    assert code == 0 and doc["keys"] == ["state_dict"]
    from safetensors.torch import load_file

    expected = CheckpointStore(str(store_dir)).load(keys="state_dict")
    loaded = load_file(str(target))
    assert set(loaded) == {f"state_dict.{k}" for k in expected["state_dict"]}
    code = main(["export", str(store_dir), "--to", str(tmp_path / "y"), "--keys", "nope"])
    assert code != 0 and "no top-level key 'nope'" in capsys.readouterr().err


class _ReadsThenRuns(FaultyStorage):
    """A reader's storage: its first read of an object runs ``hook`` (the command, run by an
    operator in the middle of the reader's load)."""

    def __init__(self, inner, hook) -> None:
        super().__init__(inner)
        self.hook, self.fired = hook, 0

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if path.startswith("packs/") and not self.fired:
            self.fired += 1
            self.hook()
        return super().get(path, start, end)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_compact_gc_and_verify_beside_a_live_writer_and_a_reader(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, capsys
) -> None:
    """Beside a training process that holds the lease, `compact` and `gc --grace 0` are refused
    (exit 4, naming the holder) and `gc --keep-last 1` with its default grace and `verify` run;
    once it stopped, `compact` then `gc --keep-last 1 --grace 0 --min-age 0`, run while an
    evaluation process is in the middle of loading, never break the reader: it loads the
    newest checkpoint exactly."""
    with backend_url(kind, request, tmp_path) as url:
        training = open_storage(url, None)
        training.url = f"{url} (training process)"  # its own process: its own lease and lock
        g = torch.Generator().manual_seed(0)
        w = torch.randn(6000, generator=g)
        with CheckpointStore(training, chunk_size=4096, pack_size=8192, full_every=100) as live:
            for step in (1, 2, 3):
                w = w + 1e-3 * torch.randn(6000, generator=g)
                live.save({"w": w, "step": step}, step).wait()
            for argv in (["compact", url], ["gc", url, "--keep-last", "1", "--grace", "0"]):
                assert main(argv) == 4, argv
                assert "being written by another process" in capsys.readouterr().err
            code, doc = run_json(capsys, "gc", url, "--keep-last", "1")
            assert code == 0 and doc["removed_steps"] == [1, 2] and doc["removed_objects"] == 0
            code, doc = run_json(capsys, "verify", url)
            assert code == 0, doc
            w = w + 1e-3 * torch.randn(6000, generator=g)
            live.save({"w": w, "step": 4}, 4).wait()  # the writer goes on
        expected = {"w": w, "step": 4}

        def operator() -> None:
            code, doc = run_json(capsys, "compact", url)
            assert code == 0 and doc["compacted"] and doc["step"] == 4, doc
            argv = ("gc", url, "--keep-last", "1", "--grace", "0", "--min-age", "0")
            code, doc = run_json(capsys, *argv)
            assert code == 0 and doc["removed_steps"] == [3] and doc["removed_objects"], doc

        reading = _ReadsThenRuns(open_storage(url, None), operator)
        reading.url = f"{url} (evaluation process)"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback past "corruption" would warn
            with CheckpointStore(reading) as reader:
                assert_state_equal(reader.load(), expected)
                assert reading.fired == 1 and reader.loaded_step == 4
        code, doc = run_json(capsys, "verify", url)
        assert code == 0, doc
        with CheckpointStore(url) as after:
            assert after.steps() == [4] and after.manifest(4).stats["full_base"]
            assert_state_equal(after.load(), expected)
