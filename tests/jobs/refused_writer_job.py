"""Launched with 2 processes (``accelerate launch --multi_gpu``, gloo on CPU) against a store
another job writes: every process creates an ``IncrementalCheckpointer`` on it and records what
it raised in ``$JOB_OUT.rank<N>.json`` (the type's names, whether it is a ``WriterLeaseError``,
the message), then the processes meet once more to show that none is left waiting."""

from __future__ import annotations

import json
import os

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_incremental import IncrementalCheckpointer
from lightning_incremental.core import WriterLeaseError


def main() -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(4, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    outcome: dict[str, object] = {"raised": None}
    try:
        IncrementalCheckpointer(accelerator, os.environ["JOB_STORE"], every_n_steps=1)
    except Exception as exc:  # recorded for the test
        outcome = {
            "raised": [cls.__name__ for cls in type(exc).__mro__],
            "writer_lease_error": isinstance(exc, WriterLeaseError),
            "message": str(exc),
        }
    outcome["weights_unchanged"] = all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )
    accelerator.wait_for_everyone()  # no process is left in a collective
    with open(f"{os.environ['JOB_OUT']}.rank{accelerator.process_index}.json", "w") as fh:
        json.dump(outcome, fh)


if __name__ == "__main__":
    main()
