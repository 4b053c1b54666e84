"""A torchrun job: 2 ranks save a sharded state (a DTensor split over both) every step with
``keep_last=1``, while the coordinator's listing of the objects is slow (as on a large object
store): its retention after step S runs while the other rank already writes its part of S+1.

    torchrun --standalone --nproc-per-node 2 tests/jobs/sharded_retention_job.py DIR OUT [AGE]

Writes OUT/rank<r>.json: each step's outcome on that rank (``"ok"`` or the error). ``AGE``:
the store's ``min_object_age_s`` (default: the store's default).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.storage import LocalStorage

LISTING_DELAY_S = 1.0
STEPS = 4


class SlowListing(LocalStorage):
    """The coordinator's storage: listing the objects takes a while."""

    def list(self, prefix: str) -> list[str]:
        if prefix.strip("/") == "packs":
            time.sleep(LISTING_DELAY_S)
        return super().list(prefix)


def main() -> None:
    directory, out = sys.argv[1], Path(sys.argv[2])
    options = {"min_object_age_s": float(sys.argv[3])} if len(sys.argv) > 3 else {}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    storage = SlowListing(directory) if rank == 0 else LocalStorage(directory)
    outcomes: dict[int, str] = {}
    with CheckpointStore(
        storage, distributed=True, keep_last=1, chunk_size=4096, pack_size=16384, **options
    ) as store:
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            full = torch.randn(8192, generator=g)  # the same on every rank
            # No collective here: rank 1 goes on to its next save while rank 0 runs retention.
            local = full.chunk(dist.get_world_size())[rank].clone()
            w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            state = {"w": w, "step": step}
            try:
                store.save(state, step).wait()
                outcomes[step] = "ok"
            except Exception as exc:  # recorded for the test, which names it
                outcomes[step] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
