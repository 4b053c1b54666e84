"""Stage-by-stage cost and what-if compression of the engine's chunk codec on real states.

``python -m benchmarks.suites.codec_profile``: trains a scenario's model for two checkpoint
intervals, then for chunks of each tensor kind (weights, exp_avg, exp_avg_sq) times every stage
of encode (hash, byte grouping, XOR, zstd, the byte-plane codecs) and decode on one thread,
best of ``--repeats`` (robust to other load on the machine), next to a plain memcpy; and
compares the compression of alternatives (zstd levels, no grouping, arithmetic delta).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from benchmarks.harness.analysis import category
from benchmarks.harness.model import FULL, FULL_EMBEDDING, QUICK, QUICK_EMBEDDING
from benchmarks.harness.scenarios import SCENARIOS, Params
from benchmarks.harness.state import clone, tensors
from benchmarks.harness.timing import best_of
from lightning_incremental.core import codecs as codec

CHUNK = 4 << 20  # the engine's default chunk size
MIN_PIECE = 64 << 10  # ignore smaller tail pieces and tensors (timings would be overhead)


def _chunks(previous: Any, current: Any, per_kind: int) -> dict[str, list[tuple]]:
    """Up to ``per_kind`` changed chunks per tensor kind: (raw, base, width)."""
    prev = dict(tensors(previous))
    out: dict[str, list[tuple]] = defaultdict(list)
    for path, t in tensors(current):
        kind = category(path)
        if kind == "other" or len(out[kind]) >= per_kind or path not in prev:
            continue
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        base = prev[path].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        width = codec.group_width(t.element_size(), t.is_complex())
        for offset in range(0, raw.size, CHUNK):
            piece, old = raw[offset : offset + CHUNK], base[offset : offset + CHUNK]
            if piece.size < MIN_PIECE:
                continue
            if len(out[kind]) < per_kind and not np.array_equal(piece, old):
                out[kind].append((piece.copy(), old.copy(), width))
    return out


def _z(cctx: zstandard.ZstdCompressor, data: Any) -> bytes:
    return cctx.compress(data)


def _sub_delta(raw: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    """Bit patterns subtracted as integers (wrapping), instead of XOR."""
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return (raw.view(dtype) - base.view(dtype)).view(np.uint8)


def profile_kind(chunks: list[tuple], repeats: int) -> dict[str, Any]:
    nbytes = sum(c[0].size for c in chunks)
    cctx = {
        lvl: zstandard.ZstdCompressor(level=lvl, write_content_size=True) for lvl in (-1, 1, 3, 9)
    }
    dctx = zstandard.ZstdDecompressor()
    width = chunks[0][2]
    grouped = [codec.group_bytes(r, w) for r, _, w in chunks]
    xors = [np.bitwise_xor(r, b) for r, b, _ in chunks]
    gx = [codec.group_bytes(x, w) for x, (_, _, w) in zip(xors, chunks)]
    full_blobs = [_z(cctx[1], g) for g in grouped]
    xor_blobs = [_z(cctx[1], g) for g in gx]
    outs = [np.empty(r.size, np.uint8) for r, _, _ in chunks]

    def each(fn: Callable[[int], Any]) -> Callable[[], Any]:
        return lambda: [fn(i) for i in range(len(chunks))]

    stages = {
        "memcpy (reference)": each(lambda i: np.copyto(outs[i], chunks[i][0])),
        "hash xxh3-128": each(lambda i: xxhash.xxh3_128_hexdigest(chunks[i][0])),
        "group bytes": each(lambda i: codec.group_bytes(chunks[i][0], width)),
        "xor": each(lambda i: np.bitwise_xor(chunks[i][0], chunks[i][1])),
        "zstd-1 compress (grouped)": each(lambda i: _z(cctx[1], grouped[i])),
        "zstd-1 compress (grouped xor)": each(lambda i: _z(cctx[1], gx[i])),
        "encode_full": each(
            lambda i: codec.STANDALONE.encode(chunks[i][0], None, width=width, level=1)
        ),
        "encode_xor": each(
            lambda i: codec.XOR.encode(chunks[i][0], chunks[i][1], width=width, level=1)
        ),
        "earlier engine encode (z or x)": each(
            lambda i: codec.encode_best(
                chunks[i][0], chunks[i][1], width, 1, candidates=[codec.STANDALONE, codec.XOR]
            )
        ),
        "planes standalone (p)": each(
            lambda i: codec.PLANES.encode(chunks[i][0], None, width=width, level=1)
        ),
        "planes delta (pd, predictor chosen)": each(
            lambda i: codec.PLANES_DELTA.encode(chunks[i][0], chunks[i][1], width=width, level=1)
        ),
        "engine encode (p or pd)": each(
            lambda i: codec.encode_best(chunks[i][0], chunks[i][1], width, 1)
        ),
        "zstd decompress (full blob)": each(lambda i: dctx.decompress(full_blobs[i])),
        "ungroup bytes": each(lambda i: codec.ungroup_bytes(grouped[i], width, outs[i])),
        "decode full": each(
            lambda i: codec.decode(
                full_blobs[i], codec.STANDALONE.kind, width, chunks[i][0].size, out=outs[i]
            )
        ),
        "decode xor link (decode + xor)": each(
            lambda i: codec.decode(
                xor_blobs[i],
                codec.XOR.kind,
                width,
                chunks[i][0].size,
                base=chunks[i][1],
                out=outs[i],
            )
        ),
    }
    best = [codec.encode_best(r, b, width, 1) for r, b, _ in chunks]
    stages["engine decode (p or pd)"] = each(
        lambda i: codec.decode(
            best[i][1], best[i][0].kind, width, chunks[i][0].size, base=chunks[i][1], out=outs[i]
        )
    )
    speeds = {name: nbytes / best_of(fn, repeats) / 1e6 for name, fn in stages.items()}

    def ratio(blobs: list[bytes]) -> float:
        return nbytes / sum(len(b) for b in blobs)

    subs = [_sub_delta(r, b, w) for r, b, w in chunks]
    ratios = {
        "standalone, zstd-1 (earlier engine)": ratio(full_blobs),
        "xor, zstd-1 (earlier engine)": ratio(xor_blobs),
        "engine: planes, predictor per chunk": ratio([b for _, b in best]),
        "standalone, zstd-3": ratio([_z(cctx[3], g) for g in grouped]),
        "xor, zstd-3": ratio([_z(cctx[3], g) for g in gx]),
        "xor, zstd-9": ratio([_z(cctx[9], g) for g in gx]),
        "xor, zstd--1": ratio([_z(cctx[-1], g) for g in gx]),
        "xor, no byte grouping, zstd-1": ratio([_z(cctx[1], x) for x in xors]),
        "integer-subtract delta, zstd-1": ratio(
            [_z(cctx[1], codec.group_bytes(s, w)) for s, (_, _, w) in zip(subs, chunks)]
        ),
    }
    return {"chunks": len(chunks), "bytes": nbytes, "MBps": speeds, "ratio": ratios}


def _table(title: str, label: str, kinds: dict[str, Any], field: str, fmt: str) -> list[str]:
    """A Markdown table: one row per entry of ``kinds[*][field]``, one column per kind."""
    names = list(kinds)
    lines = [
        f"### {title}",
        "",
        f"| {label} | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in next(iter(kinds.values()))[field]:
        cells = " | ".join(fmt.format(kinds[k][field][row]) for k in names)
        lines.append(f"| {row} | {cells} |")
    lines.append("")
    return lines


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for scenario, kinds in results.items():
        if not kinds:  # e.g. LoRA: every changed tensor is smaller than MIN_PIECE
            lines += [f"### {scenario}: no changed chunk of {MIN_PIECE >> 10} KiB or more", ""]
            continue
        lines += _table(
            f"{scenario}: single-thread MB/s (best of repeats)", "stage", kinds, "MBps", "{:.0f}"
        )
        lines += _table(
            f"{scenario}: compression ratio of changed chunks", "encoding", kinds, "ratio", "{:.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m benchmarks.suites.codec_profile"
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scenarios", default="dense_fp32,bf16")
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--chunks", type=int, default=8, help="chunks per tensor kind")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    cfg, embedding = (QUICK, QUICK_EMBEDDING) if args.quick else (FULL, FULL_EMBEDDING)
    results: dict[str, dict[str, Any]] = {}
    for name in args.scenarios.split(","):
        work = SCENARIOS[name].build(Params(model=cfg, embedding=embedding, interval=args.interval))
        work.train(args.interval)
        previous = clone(work.state(args.interval))
        work.train(args.interval)
        chunks = _chunks(previous, work.state(2 * args.interval), args.chunks)
        results[name] = {
            kind: profile_kind(c, args.repeats) for kind, c in sorted(chunks.items()) if c
        }
        del work, previous, chunks
    text = markdown(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
