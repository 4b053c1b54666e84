"""A live writer of a store in another process, and what a test compares to say it was left
alone.

:func:`live_writer` starts a process that takes the store's writer lease (``gc`` without a grace
period takes it, as any write does, and deletes nothing the store's checkpoints need) and keeps
it, its heartbeat running, as a training run between two saves does: a real second holder of
the lease, launched as job ``live-job`` (torchrun's run id). On leaving, it checks its lease as
a commit does first: :attr:`LiveWriter.still_writer` says whether it still held it then.

:func:`store_files` is everything a store holds, to compare before and after: each object's
bytes, except the lease records, whose heartbeats change while they live, and which are
described by their holder instead (its owner and whether it released the lease).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = "live-job"

_CHILD = textwrap.dedent(
    """
    import sys
    from lightning_incremental.core import CheckpointStore
    store = CheckpointStore(sys.argv[1], fsync=False)
    store.gc()  # takes the writer lease, as every write does
    print("holding", flush=True)
    sys.stdin.readline()
    try:
        store._lease.check()  # what a commit checks first: its record is still the newest
        print("still the writer", flush=True)
    except Exception as exc:
        print(f"lost: {type(exc).__name__}: {exc}", flush=True)
    store.close()
    """
)


@dataclass
class LiveWriter:
    process: subprocess.Popen[str]
    still_writer: bool | None = None  # set on leaving the context

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def live_writer(url: str | os.PathLike[str]) -> Iterator[LiveWriter]:
    """A process holding the writer lease of the store at ``url`` meanwhile (see the module)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["TORCHELASTIC_RUN_ID"] = JOB
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, os.fspath(url)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    writer = LiveWriter(child)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "holding"
        yield writer
        child.stdin.write("go\n")
        child.stdin.flush()
        answer = child.stdout.readline().strip()
        writer.still_writer = answer == "still the writer"
        assert child.wait(60) == 0, answer
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(60)


def store_files(url: str | os.PathLike[str]) -> dict[str, Any]:
    """Every object under the local store ``url``: its bytes, or for a lease record its holder
    and whether it was released."""
    root = Path(url)
    found: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if name.startswith("lease/") and name.endswith(".json"):
            doc = json.loads(data)
            found[name] = (doc["owner"], doc["pid"], doc["released"])
        else:
            found[name] = data
    return found
