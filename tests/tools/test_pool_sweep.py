"""The sweep benchmark's runs, in this process on a tiny model: forks of one base store keep
one copy of the frozen weights where separate stores keep one per run."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.model import ModelConfig
from benchmarks.suites import pool_sweep

TINY = ModelConfig(vocab=512, d_model=64, layers=1, heads=2, ff=128, seq=8, batch=2)


def stored(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_forks_store_the_base_once(tmp_path: Path) -> None:
    sizes = {}
    for mode in ("separate", "fork"):
        root = tmp_path / mode
        root.mkdir()
        if mode == "fork":
            pool_sweep.base_store(root, TINY)
        for run in range(2):
            pool_sweep.child(mode, run, root, TINY, steps=1)
        sizes[mode] = stored(root)
    assert sizes["fork"] < 0.75 * sizes["separate"], sizes
