"""ensure_fork, shared by the plug-ins' fork_from: a fork interrupted before its manifest is
refused with the way out, not taken for a fresh store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.runtime.session.fork import check_source, ensure_fork, split_step


def test_an_interrupted_fork_is_refused_with_the_way_out(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    with CheckpointStore(src) as store:
        store.save({"w": torch.ones(4)}, step=3).wait()
    assert ensure_fork(str(dst), f"{src}@3") == 3
    assert ensure_fork(str(dst), str(src)) is None  # a restart: nothing forked again
    shutil.rmtree(dst / "manifests")  # the fork died after its links, before its manifest
    with pytest.raises(ConfigError, match=r"holds no checkpoint .*unpin"):
        ensure_fork(str(dst), str(src))


def test_sources_are_parsed_and_checked() -> None:
    assert split_step("s3://b/x@y/run@12") == ("s3://b/x@y/run", 12)
    assert check_source(None) is None and check_source(Path("/a")) == "/a"
    for bad in ("", 3):
        with pytest.raises(ConfigError, match="SRC@STEP"):
            check_source(bad)
