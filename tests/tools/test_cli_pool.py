"""The command's pool and fork commands: fork SRC@STEP DST, unpin, pool-gc, pool-leave, and
ls/inspect of pools, members and forks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.cli import main
from lightning_incremental.cli_pool import split_step
from lightning_incremental.core import CheckpointStore
from tests.conftest import assert_state_equal

OPTIONS: dict[str, Any] = {"chunk_size": 4096, "fsync": False, "min_object_age_s": 0.0}


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 256, generator=g), "head": torch.full((8,), float(step))}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_split_step() -> None:
    assert split_step("/runs/a@12") == ("/runs/a", 12)
    assert split_step("/runs/a") == ("/runs/a", None)
    assert split_step("s3://b/x@y/run") == ("s3://b/x@y/run", None)


def test_fork_ls_inspect_unpin_and_pool_gc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst, pool = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "pool")
    with CheckpointStore(src, pool=pool, **OPTIONS) as store:
        for step in (1, 2, 3):
            store.save(state(step), step).wait()
    doc = run_json(capsys, "fork", f"{src}@2", dst)
    assert doc == {"source": src, "step": 2, "fork": dst, "as_base": False}
    with CheckpointStore(dst) as fork:
        assert_state_equal(fork.load(), state(2))
    listed = run_json(capsys, "ls", dst)
    assert [r["step"] for r in listed["checkpoints"]] == [2]
    assert listed["objects_in"] == pool and listed["forked_from"] == {"url": src, "step": 2}
    assert run_json(capsys, "ls", src)["pinned_by_forks"] == [{"step": 2, "fork": dst}]
    members = run_json(capsys, "ls", pool)
    assert sorted(m["member"] for m in members["members"]) == [dst, src]
    inspected = run_json(capsys, "inspect", dst)
    assert set(inspected["object_bytes_by_location"]) == {"pool"}
    assert inspected["tensors"]
    # The fork is in the source's pool: its own manifests keep what it needs there.
    assert main(["unpin", src, dst]) == 0
    assert main(["unpin", src, dst]) == 3  # no such pin any more
    capsys.readouterr()
    gc = run_json(capsys, "pool-gc", pool, "--min-age", "0")
    assert sorted(gc["members"]) == [dst, src]


def test_fork_as_base_makes_the_step_a_delta_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(state(1), 1).wait()
    doc = run_json(capsys, "fork", src, dst, "--as-base")
    assert doc == {"source": src, "step": 1, "fork": dst, "as_base": True}
    assert run_json(capsys, "ls", src)["pinned_by_forks"] == [{"step": 1, "fork": dst}]
    with CheckpointStore(dst, **OPTIONS) as fork:
        assert fork.steps() == []
        result = fork.save(state(0), 0).wait()  # its own steps, the weights referenced
    assert result.bytes_written < 64 * 256 * 4 / 4
    listed = run_json(capsys, "ls", dst)
    assert [r["step"] for r in listed["checkpoints"]] == [0]
    assert listed["forked_from"] == {"url": src, "step": 1, "as_base": True}
    assert main(["unpin", src, dst]) == 2  # the fork still names the source's objects
    capsys.readouterr()


def test_inspect_of_a_plain_fork_shows_owned_and_source_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(state(1), 1).wait()
    assert main(["fork", src, dst]) == 0
    with CheckpointStore(dst, **OPTIONS) as fork:
        fork.load()
        fork.save(state(2), 2).wait()
    capsys.readouterr()
    where = run_json(capsys, "inspect", dst, "2")["object_bytes_by_location"]
    assert set(where) == {"owned", f"source {src}"}
    assert where[f"source {src}"] > 10 * where["owned"]
    assert main(["inspect", dst]) == 0
    assert "object bytes by location" in capsys.readouterr().out


def test_pool_leave(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool, member = str(tmp_path / "pool"), str(tmp_path / "m")
    with CheckpointStore(member, pool=pool, **OPTIONS) as store:
        store.save(state(1), 1).wait()
    assert main(["pool-leave", pool, member]) == 2  # still holds checkpoints
    assert "still holds checkpoints" in capsys.readouterr().err


def test_verify_and_export_of_a_fork_read_the_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(state(1), 1).wait()
    assert main(["fork", f"{src}@1", dst]) == 0
    assert main(["verify", dst]) == 0
    for fmt, name in (("torch", "out.pt"), ("dcp", "out_dcp")):
        assert main(["export", dst, "--to", str(tmp_path / name), "--format", fmt]) == 0
    assert_state_equal(torch.load(tmp_path / "out.pt", weights_only=True), state(1))
    assert (tmp_path / "out_dcp").is_dir()
