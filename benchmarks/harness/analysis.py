"""Where the bytes and the encode time go, per tensor kind (model weights, AdamW ``exp_avg``,
``exp_avg_sq``, other), with the codecs applied directly to the chunks of two consecutive
checkpoints.

For every changed chunk (unchanged ones cost nothing): *before*, the earlier engine's race of
byte-grouped zstd standalone (``z``) or XOR delta (``x``); *after*, today's default race (byte
planes, ``p``/``pd``). Each encoded and decoded on one thread, timed. Where the optional
packages are importable, the peers code the same chunks' XOR delta the same way: zipnn (Huffman)
and blosc2 (byte shuffle + zstd level 1), codec only. Then today's codec once more on two
threads (:func:`two_threads`): what two threads of this machine encode and decode per second.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from benchmarks.harness.state import tensors
from lightning_incremental.core import codecs as codec
from lightning_incremental.core.chunks.hints import HINT_TTL


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


def _peers() -> dict[str, tuple[Callable[..., bytes], Callable[..., Any]]]:
    """The importable peer coders: name -> (encode(xor, width), decode(blob, width))."""
    out: dict[str, tuple[Callable[..., bytes], Callable[..., Any]]] = {}
    try:
        import blosc2

        def bl_enc(x: np.ndarray, w: int) -> bytes:
            return bytes(
                blosc2.compress2(
                    x,
                    typesize=w,
                    clevel=1,
                    codec=blosc2.Codec.ZSTD,
                    filters=[blosc2.Filter.SHUFFLE],
                    nthreads=1,
                )
            )

        out["blosc2 shuffle+zstd-1"] = (bl_enc, lambda b, w: blosc2.decompress2(b, nthreads=1))
    except ImportError:
        pass
    try:
        from zipnn import ZipNN

        coders: dict[int, Any] = {}

        def zn(w: int) -> Any:
            if w not in coders:
                dtype = {4: "float32", 2: "bfloat16"}.get(w, "float32")
                coders[w] = ZipNN(
                    method="HUFFMAN", input_format="byte", bytearray_dtype=dtype, threads=1
                )
            return coders[w]

        out["zipnn"] = (
            lambda x, w: bytes(zn(w).compress(x.tobytes())),
            lambda b, w: zn(w).decompress(b),
        )
    except ImportError:
        pass
    return out


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def breakdown(previous: Any, current: Any, *, chunk_size: int, level: int) -> dict[str, Any]:
    """Per kind: logical and unchanged bytes, then for the changed chunks the bytes and the
    single-thread encode/decode MB/s of the earlier engine (``before``), of today's (``after``)
    and of each importable peer."""
    prev = dict(tensors(previous))
    peers = _peers()
    old = [codec.STANDALONE, codec.XOR]
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    changed_chunks: list[tuple[np.ndarray, np.ndarray | None, int]] = []
    for path, tensor in tensors(current):
        if tensor.numel() == 0:
            continue
        row = rows[category(path)]
        raw = _raw(tensor)
        before = prev.get(path)
        base = (
            _raw(before)
            if before is not None and before.shape == tensor.shape and before.dtype == tensor.dtype
            else None
        )
        width = codec.group_width(tensor.element_size(), tensor.is_complex())
        dtype = str(tensor.dtype).removeprefix("torch.")
        row["dtype"] = dtype if row.get("dtype", dtype) == dtype else "mixed"
        for offset in range(0, raw.size, chunk_size):
            piece = raw[offset : offset + chunk_size]
            row["logical"] += piece.size
            old_piece = base[offset : offset + chunk_size] if base is not None else None
            if old_piece is not None and np.array_equal(piece, old_piece):
                row["unchanged"] += piece.size
                continue
            row["changed"] += piece.size
            changed_chunks.append((piece, old_piece, width))
            for name, candidates in (("before", old), ("after", None)):
                (chosen, blob), enc = _timed(
                    codec.encode_best, piece, old_piece, width, level, candidates=candidates
                )
                _, dec = _timed(codec.decode, blob, chosen.kind, width, piece.size, base=old_piece)
                row[f"{name}_bytes"] += len(blob)
                row[f"{name}_enc_s"] += enc
                row[f"{name}_dec_s"] += dec
            delta = piece ^ old_piece if old_piece is not None else piece
            for name, (enc_fn, dec_fn) in peers.items():
                blob, enc = _timed(enc_fn, delta, width)
                _, dec = _timed(dec_fn, blob, width)
                row[f"{name}_bytes"] += len(blob)
                row[f"{name}_enc_s"] += enc
                row[f"{name}_dec_s"] += dec
    out: dict[str, Any] = {}
    coders = ["before", "after", *peers]
    for name, row in sorted(rows.items()):
        changed = row["changed"]
        entry: dict[str, Any] = {
            "dtype": row["dtype"],
            "logical_bytes": int(row["logical"]),
            "unchanged_bytes": int(row["unchanged"]),
            "changed_bytes": int(changed),
        }
        for c in coders:
            written = row[f"{c}_bytes"]
            entry[c] = {
                "bytes": int(written),
                "ratio": row["logical"] / written if written else None,
                "encode_MBps": changed / row[f"{c}_enc_s"] / 1e6 if row[f"{c}_enc_s"] else None,
                "decode_MBps": changed / row[f"{c}_dec_s"] / 1e6 if row[f"{c}_dec_s"] else None,
            }
        out[name] = entry
    total = {c: sum(r[c]["bytes"] for r in out.values()) for c in coders}
    logical = sum(r["logical_bytes"] for r in out.values())
    out["all"] = {
        "dtype": "-",
        "logical_bytes": logical,
        "unchanged_bytes": sum(r["unchanged_bytes"] for r in out.values()),
        "changed_bytes": sum(r["changed_bytes"] for r in out.values()),
        **{
            c: {
                "bytes": total[c],
                "ratio": logical / total[c] if total[c] else None,
                "encode_MBps": _harmonic(out, c, "encode_MBps"),
                "decode_MBps": _harmonic(out, c, "decode_MBps"),
            }
            for c in coders
        },
        **two_threads(changed_chunks, level),
    }
    return out


THREADS = 2
PASSES = 3  # two_threads: best of this many passes over the chunks


def two_threads(
    chunks: list[tuple[np.ndarray, np.ndarray | None, int]], level: int
) -> dict[str, float | None]:
    """Today's codec on ``THREADS`` threads over ``chunks`` (raw, base, width), wall clock, the
    best of ``PASSES`` passes each:

    * ``encode_2t_race_MBps``: every chunk encoded with the predictor race, as the first save
      after a restart codes every place;
    * ``encode_2t_hinted_MBps``: every chunk coded the way the race chose for it, as a save
      codes a place whose choice it remembers (``hints.Hints``);
    * ``encode_2t_MBps``: a save's steady state, where each place races every ``HINT_TTL``-th
      save and reuses its choice at the others (time: hinted + (race - hinted) / HINT_TTL);
    * ``decode_2t_MBps``: every payload decoded into memory already touched (a restore's
      destination).

    The codec releases the GIL in zstd and numpy, so the threads can run at once; how much
    faster that is than one thread depends on what the CPUs deliver (the report's header
    says)."""
    keys = ("encode_2t_MBps", "encode_2t_race_MBps", "encode_2t_hinted_MBps", "decode_2t_MBps")
    if not chunks:
        return dict.fromkeys(keys)
    total = sum(raw.size for raw, _, _ in chunks)
    outs = [np.zeros(raw.size, dtype=np.uint8) for raw, _, _ in chunks]

    def encode(index: int, hinted: bool = False) -> tuple[str, Any, codec.Hint | None]:
        raw, base, width = chunks[index]
        hint = hints[index] if hinted else None
        chosen, blob, made = codec.encode_choice(raw, base, width, level, hint=hint)
        return chosen.kind, blob, made

    def decode(index: int, coded: list[tuple[str, Any, Any]]) -> None:
        raw, base, width = chunks[index]
        kind, blob, _ = coded[index]
        codec.decode(blob, kind, width, raw.size, base=base, out=outs[index])

    def best(fn: Callable[[int], Any]) -> tuple[list[Any], float]:
        fastest, results = float("inf"), []
        for _ in range(PASSES):  # a pass takes about 0.1 s: the best of a few is the codec's
            results, seconds = _timed(lambda: list(pool.map(fn, range(len(chunks)))))
            fastest = min(fastest, seconds)
        return results, fastest

    hints: list[codec.Hint | None] = []
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(encode, range(min(len(chunks), THREADS * 2))))  # scratch memory, once
        raced, race = best(encode)
        hints = [made for _, _, made in raced]
        reused, hinted = best(lambda i: encode(i, hinted=True))
        dec = best(lambda i: decode(i, raced))[1]
        for coded in (raced, reused):
            list(pool.map(decode, range(len(chunks)), [coded] * len(chunks)))
            if any(not np.array_equal(out, raw) for out, (raw, _, _) in zip(outs, chunks)):
                raise AssertionError("two-thread decoding differs from the chunks encoded")
    steady = hinted + (race - hinted) / HINT_TTL
    return dict(zip(keys, (total / t / 1e6 for t in (steady, race, hinted, dec))))


def _harmonic(rows: dict[str, Any], coder: str, key: str) -> float | None:
    """Changed bytes over the summed seconds of every kind."""
    seconds = sum(r["changed_bytes"] / 1e6 / r[coder][key] for r in rows.values() if r[coder][key])
    changed = sum(r["changed_bytes"] for r in rows.values() if r[coder][key])
    return changed / 1e6 / seconds if seconds else None
