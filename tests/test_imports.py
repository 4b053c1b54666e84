"""The engine and the Accelerate adapter must never import Lightning."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["lightning_incremental.core", "accelerate_incremental", "lightning_incremental"]
)
def test_import_does_not_load_lightning(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric', 'accelerate'))\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_public_surface() -> None:
    import lightning_incremental
    import lightning_incremental.core as core

    for name in core.__all__:
        assert hasattr(core, name)
    assert lightning_incremental.CheckpointStore is core.CheckpointStore
    with pytest.raises(AttributeError, match="no attribute"):
        lightning_incremental.DoesNotExist  # noqa: B018
