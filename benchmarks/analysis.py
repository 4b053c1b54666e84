"""Where the bytes and the encode time go: the engine's chunk codec applied directly to the
tensors of two consecutive checkpoints, grouped by what the tensors are (model weights, AdamW
``exp_avg``, ``exp_avg_sq``, other).

For every chunk: unchanged chunks cost nothing; changed ones are encoded standalone and as XOR
against the previous checkpoint's chunk, and the smaller counts (the engine's choice, without
its chain-length bound).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import xxhash

from benchmarks.state import tensors
from lightning_incremental.core import codecs as codec


def category(path: str) -> str:
    """``weights``, an optimizer state's own name (AdamW ``exp_avg`` / ``exp_avg_sq``, Adagrad
    ``sum``; its scalar ``step`` counts as ``other``), or ``other``."""
    leaf = path.rsplit("/", 1)[-1]
    if path.startswith("/state_dict/"):
        return "weights"
    if path.startswith("/optimizer_states/") and "/state/" in path and leaf != "step":
        return leaf
    return "other"


def _raw(t: torch.Tensor) -> Any:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def breakdown(previous: Any, current: Any, *, chunk_size: int, level: int) -> dict[str, Any]:
    """Per category: logical bytes, unchanged bytes, standalone / XOR / best encoded bytes and
    single-thread seconds spent hashing and encoding."""
    prev = dict(tensors(previous))
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    for path, tensor in tensors(current):
        if tensor.numel() == 0:
            continue
        row = rows[category(path)]
        raw = _raw(tensor)
        old = prev.get(path)
        base = (
            _raw(old)
            if old is not None and old.shape == tensor.shape and (old.dtype == tensor.dtype)
            else None
        )
        width = codec.group_width(tensor.element_size(), tensor.is_complex())
        dtype = str(tensor.dtype).removeprefix("torch.")
        row["dtype"] = dtype if row.get("dtype", dtype) == dtype else "mixed"
        for offset in range(0, raw.size, chunk_size):
            piece = raw[offset : offset + chunk_size]
            row["logical"] += piece.size
            start = time.perf_counter()
            digest = xxhash.xxh3_128_hexdigest(piece)
            row["hash_s"] += time.perf_counter() - start
            old_piece = base[offset : offset + chunk_size] if base is not None else None
            if old_piece is not None and xxhash.xxh3_128_hexdigest(old_piece) == digest:
                row["unchanged"] += piece.size
                continue
            start = time.perf_counter()
            full = len(codec.STANDALONE.encode(piece, None, width=width, level=level))
            row["full_s"] += time.perf_counter() - start
            row["full"] += full
            best = full
            if old_piece is not None:
                start = time.perf_counter()
                xor = len(codec.XOR.encode(piece, old_piece, width=width, level=level))
                row["xor_s"] += time.perf_counter() - start
                row["xor"] += xor
                row["xor_raw"] += piece.size
                best = min(full, xor)
            row["best"] += best
    out: dict[str, Any] = {}
    for name, row in sorted(rows.items()):
        logical = row["logical"]
        changed = logical - row["unchanged"]
        out[name] = {
            "dtype": row["dtype"],
            "logical_bytes": int(logical),
            "unchanged_bytes": int(row["unchanged"]),
            "full_bytes": int(row["full"]),
            "xor_bytes": int(row["xor"]),
            "best_bytes": int(row["best"]),
            "ratio_full": changed / row["full"] if row["full"] else None,
            "ratio_xor": row["xor_raw"] / row["xor"] if row["xor"] else None,
            "ratio_best": logical / row["best"] if row["best"] else None,
            "hash_MBps": logical / row["hash_s"] / 1e6 if row["hash_s"] else None,
            "full_MBps": changed / row["full_s"] / 1e6 if row["full_s"] else None,
            "xor_MBps": row["xor_raw"] / row["xor_s"] / 1e6 if row["xor_s"] else None,
        }
    total_best = sum(r["best_bytes"] for r in out.values())
    for r in out.values():
        r["share_of_written"] = r["best_bytes"] / total_best if total_best else 0.0
    return out


def markdown(per_scenario: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| scenario | tensors | dtype | MB | unchanged | ratio standalone | ratio XOR | "
        "ratio best | share of bytes | hash MB/s | standalone MB/s | XOR MB/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, rows in per_scenario.items():
        for name, r in rows.items():
            lines.append(
                f"| {scenario} | {name} | {r['dtype']} | {r['logical_bytes'] / 1e6:.1f} | "
                f"{r['unchanged_bytes'] / max(r['logical_bytes'], 1):.0%} | "
                f"{_f(r['ratio_full'])} | {_f(r['ratio_xor'])} | {_f(r['ratio_best'])} | "
                f"{r['share_of_written']:.0%} | {_f(r['hash_MBps'], 0)} | "
                f"{_f(r['full_MBps'], 0)} | {_f(r['xor_MBps'], 0)} |"
            )
    return "\n".join(lines)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
