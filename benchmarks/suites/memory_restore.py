"""Restore from the memory tier against ``torch.load`` and a plain gloo send, each in the same run.

``python -m benchmarks.suites.memory_restore [--mb N] [--repeats R] [--quick] [--out DIR]``

* **Own node's memory**: a process takes one memory step of a state of ``--mb`` MB (float32
  tensors of 16 MiB, the benchmark's default 512 MB) into a memory directory under ``/dev/shm``
  and writes the same state with ``torch.save`` beside it. Then, each in a fresh process (imports
  done first, only the restore timed): the memory tier's resume as a restarted single process
  runs it (``MemorySteps`` opened on the directory, ``resume``: the inventory, the agreement, the
  part read and its hashes checked, the tensors made), against ``torch.load`` of the file (from
  the page cache: tmpfs). Best of ``--repeats`` each.
* **From a peer**: two processes on gloo over loopback, each a node with its own memory
  directory, take one memory step each (replicated to the other). Then, ``--repeats`` times: the
  second empties its memory directory and both resume as the next generation (a restart); the
  second's part comes from the first (the agreement, the transfer, the hash check, the
  tensors). Against a plain gloo send of the same number of bytes between the same two
  processes, received into new memory as a resume must, in the same rounds. Figures in MB/s of
  the part, best of the rounds.

Writes ``memory_restore.{json,md}`` under ``--out`` (default ``bench_out``; the results committed
under ``benchmarks/results/`` come from ``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TENSOR_BYTES = 16 << 20

_COMMON = """
import json, os, shutil, sys, time
from pathlib import Path
import torch
from lightning_incremental.runtime.memory.steps import MemoryOptions, MemorySteps
torch.set_num_threads(1)

def state(mb, seed):
    g = torch.Generator().manual_seed(seed)
    n = max(1, (mb << 20) // TENSOR_BYTES)
    return {"model": {f"w{i}": torch.randn(TENSOR_BYTES // 4, generator=g) for i in range(n)},
            "step": 1}

def steps(directory, rank=0, world=1, generation=None):
    return MemorySteps(MemoryOptions(1, 1, str(directory)), rank=rank, world_size=world,
        ranks_per_node=1, url="bench://memory-restore", generation=generation,
        allow_pickle=False, owner="bench", info=lambda t: None, warn=print)

def check(part, step):
    assert part["step"] == step
"""

_WRITE = """
mb, d = int(sys.argv[1]), Path(sys.argv[2])
s = state(mb, 0)
m = steps(d / "memory")
m.take(1, s)
m.wait()
m.close()
torch.save(s, d / "plain.pt")
print(json.dumps({"part_bytes": sum(f.stat().st_size for f in (d / "memory").rglob("data.bin"))}))
"""

_READ = """
kind, d = sys.argv[1], Path(sys.argv[2])
if kind == "torch":
    started = time.perf_counter()
    loaded = torch.load(d / "plain.pt", weights_only=True)
    seconds = time.perf_counter() - started
else:
    started = time.perf_counter()
    m = steps(d / "memory")
    found = m.resume(None, check)
    seconds = time.perf_counter() - started
    assert found is not None and found[2] == "memory", found
    loaded = found[1]
    m.close()
assert sum(t.numel() for t in loaded["model"].values()) > 0
print(json.dumps({"seconds": seconds}))
"""

_PEER = """
import torch.distributed as dist
mb, d, repeats = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
mine = d / f"node{rank}"
s = state(mb, rank)
nbytes = sum(t.nbytes for t in s["model"].values())
m = steps(mine, rank, 2, 1)
m.take(1, s)
m.wait()
buf = torch.empty(nbytes, dtype=torch.uint8)
rows = []
for k in range(1, repeats + 1):
    dist.barrier()
    started = time.perf_counter()  # a plain send of as many bytes, first node to second
    if rank == 0:
        dist.send(buf, dst=1)
    else:
        dist.recv(torch.empty(nbytes, dtype=torch.uint8), src=0)  # into new memory, as a resume
    send_s = time.perf_counter() - started
    if rank == 1:  # this node loses its memory
        for part in [p for p in mine.glob("*/s*") if p.is_dir()]:
            shutil.rmtree(part)
    dist.barrier()
    m.close()  # a restart: the next generation opens the memory tier and resumes
    m = steps(mine, rank, 2, k + 1)
    started = time.perf_counter()
    found = m.resume(None, check)
    resume_s = time.perf_counter() - started
    assert found is not None and found[0] == k and found[2] == "peer", found
    rows.append({"send_s": send_s, "resume_s": resume_s, "bytes": nbytes})
    s = found[1]
    s["step"] = k + 1
    m.take(k + 1, s)  # the next round's step, on both nodes again
    m.wait()
dist.barrier()
m.close()
if rank == 1:
    print(json.dumps(rows))
sys.stdout.flush()
os._exit(0)
"""


def _script(code: str) -> str:
    return f"TENSOR_BYTES = {TENSOR_BYTES}\n" + _COMMON + code


def _env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on the path, and ``extra``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _script(code), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


def own_memory(mb: int, repeats: int, scratch: Path) -> dict[str, Any]:
    """Best seconds of a resume from this node's memory and of ``torch.load``, each in a fresh
    process."""
    d = scratch / "own"
    d.mkdir()
    written = json.loads(_python(_WRITE, str(mb), str(d)))
    best = {"memory": float("inf"), "torch": float("inf")}
    for _ in range(repeats):
        for kind in best:
            seconds = json.loads(_python(_READ, kind, str(d)))["seconds"]
            best[kind] = min(best[kind], seconds)
    return {
        "part_bytes": written["part_bytes"],
        "memory_s": best["memory"],
        "torch_load_s": best["torch"],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def from_peer(mb: int, repeats: int, scratch: Path) -> dict[str, Any]:
    """Best seconds of a resume whose part comes from the other node, and of a plain gloo send of
    as many bytes, over the same rounds."""
    d = scratch / "peer"
    d.mkdir()
    port = str(_free_port())
    code = _script(_PEER)
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   LOCAL_RANK="0", OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(mb), str(d), str(repeats)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"peer benchmark process failed:\n{out[-2000:]}{err[-4000:]}")
    rows = json.loads(outs[1][0].strip().splitlines()[-1])
    nbytes = rows[0]["bytes"]
    return {
        "part_bytes": nbytes,
        "resume_s": min(r["resume_s"] for r in rows),
        "gloo_send_s": min(r["send_s"] for r in rows),
        "rounds": rows,
    }


def report(own: dict[str, Any], peer: dict[str, Any]) -> str:
    mb = own["part_bytes"] / 1e6
    pmb = peer["part_bytes"] / 1e6
    lines = [
        "| restore | part | ours | baseline | ratio | ours, MB/s | baseline, MB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| own node's memory, fresh process | {mb:.0f} MB | {own['memory_s']:.3f} s | "
        f"{own['torch_load_s']:.3f} s (torch.load, page cache) | "
        f"{own['memory_s'] / own['torch_load_s']:.2f}x | {mb / own['memory_s']:.0f} | "
        f"{mb / own['torch_load_s']:.0f} |",
        f"| from a peer (gloo, loopback) | {pmb:.0f} MB | {peer['resume_s']:.3f} s | "
        f"{peer['gloo_send_s']:.3f} s (plain gloo send) | "
        f"{peer['resume_s'] / peer['gloo_send_s']:.2f}x | {pmb / peer['resume_s']:.0f} | "
        f"{pmb / peer['gloo_send_s']:.0f} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites.memory_restore")
    parser.add_argument("--mb", type=int, default=None, help="state size in MB (default 512)")
    parser.add_argument("--repeats", type=int, default=None, help="best of (default 3)")
    parser.add_argument("--quick", action="store_true", help="32 MB, best of 1")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    mb = args.mb or (32 if args.quick else 512)
    repeats = args.repeats or (1 if args.quick else 3)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(
        prefix="li-bench-restore-", dir=shm if shm.is_dir() else None
    ) as scratch:
        own = own_memory(mb, repeats, Path(scratch))
        peer = from_peer(mb, repeats, Path(scratch))
    from benchmarks.harness.machine import describe

    doc = {"machine": describe(), "loadavg": os.getloadavg(), "mb": mb, "own": own, "peer": peer}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_restore.json").write_text(json.dumps(doc, indent=1))
    text = report(own, peer)
    (out / "memory_restore.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
