"""The layers' imports point down only: adapters -> runtime -> core; the engine, the runtime and
the Accelerate adapter never import Lightning (nor the Lightning adapter's modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _loaded_after_import(module: str) -> list[str]:
    """The modules a fresh interpreter holds after ``import module``."""
    code = f"import sys, {module}\nprint(','.join(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip().split(",")


_FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate")
_ROOT = ("lightning_incremental", "lightning_incremental._version")  # the package and its version


@pytest.mark.parametrize(
    "module",
    [
        "lightning_incremental.core",
        "lightning_incremental.runtime",
        "accelerate_incremental",
        "lightning_incremental",
    ],
)
def test_import_does_not_load_lightning(module: str) -> None:
    frameworks = [m for m in _loaded_after_import(module) if m.split(".")[0] in _FRAMEWORKS]
    assert frameworks == [], f"importing {module} loaded {frameworks}"


def _ours(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] == "lightning_incremental"]


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_engine_does_not_load_the_runtime() -> None:
    loaded = _ours(_loaded_after_import("lightning_incremental.core"))
    assert [m for m in loaded if _under(m, "lightning_incremental.runtime")] == []


def test_the_runtime_loads_only_the_engine() -> None:
    loaded = _ours(_loaded_after_import("lightning_incremental.runtime"))
    allowed = ("lightning_incremental.core", "lightning_incremental.runtime")
    others = [m for m in loaded if not _under(m, *allowed) and m not in _ROOT]
    assert others == [], f"the runtime loaded {others}"


def test_accelerate_adapter_uses_only_the_engine_and_the_runtime() -> None:
    """No private module of the Lightning adapter (``lightning_incremental._*``), no Lightning:
    only the package root (its version), ``core`` and ``runtime``."""
    loaded = _loaded_after_import("accelerate_incremental")
    allowed = ("lightning_incremental.core", "lightning_incremental.runtime")
    others = [m for m in _ours(loaded) if not _under(m, *allowed) and m not in _ROOT]
    assert others == [], f"accelerate_incremental loaded {others}"
    assert "lightning" not in loaded


def test_public_surface() -> None:
    import lightning_incremental
    import lightning_incremental.core as core

    for name in core.__all__:
        assert hasattr(core, name)
    assert lightning_incremental.CheckpointStore is core.CheckpointStore
    for name in lightning_incremental.__all__:  # the lazy names too, and nothing else
        assert getattr(lightning_incremental, name) is not None
    assert set(lightning_incremental._LAZY) <= set(lightning_incremental.__all__)
    with pytest.raises(AttributeError, match="no attribute"):
        lightning_incremental.DoesNotExist  # noqa: B018


def test_transformers_is_imported_only_by_a_script_that_uses_the_trainer(tmp_path: Path) -> None:
    """Neither importing the Accelerate adapter nor running the launch module for a script
    without a Trainer imports ``transformers``."""
    assert "transformers" not in _loaded_after_import("accelerate_incremental")
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('transformers' in sys.modules)\n")
    cmd = [sys.executable, "-m", "accelerate_incremental", "--dirpath", str(tmp_path / "s")]
    out = subprocess.run(
        [*cmd, str(script)], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
