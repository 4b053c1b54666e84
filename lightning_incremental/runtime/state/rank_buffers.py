"""A rank's own buffers: under ``DistributedDataParallel(broadcast_buffers=False)`` each rank's
buffers (batch norm statistics, counters) are its own, while a checkpoint's weights come from
one rank. The adapters save each rank's with its random state and put them back on resume, so
that such a resume is exact. Framework-free (torch only).
"""

from __future__ import annotations

from typing import Any

import torch


def kept_apart(model: Any) -> bool:
    """Whether ``model`` (as prepared: a DDP wrapper or the module) keeps each rank's buffers
    apart: DDP with ``broadcast_buffers=False``. Anything else has rank 0's at every forward."""
    return not getattr(model, "broadcast_buffers", True)


def own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s buffers as its state dict names them, copied to host memory."""
    named = dict(module.named_buffers())
    kept = {k: v for k, v in module.state_dict().items() if k in named}
    return {k: v.detach().to("cpu", copy=True) for k, v in kept.items()}


def put(module: torch.nn.Module, saved: dict[str, torch.Tensor] | None) -> None:
    """Copy ``saved`` (from :func:`own`) into ``module``'s buffers of the same names."""
    if not saved:
        return
    live = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in saved.items():
            if name in live:
                live[name].copy_(value)
