"""LoRA-style adapters on a frozen :class:`~benchmarks.harness.model.TinyLM`.

Each adapted weight ``W`` (attention in/out projections, both MLP linears) becomes
``W + B @ A`` through ``torch.nn.utils.parametrize``: ``W`` is frozen and kept in the state dict
as ``...parametrizations.<name>.original``, the low-rank ``A`` (``rank x in``, random) and ``B``
(``out x rank``, zeros, so training starts from the base model) are the only trainable tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from benchmarks.harness.model import TinyLM


class LowRankDelta(nn.Module):
    """The parametrization ``W -> W + B @ A``."""

    def __init__(self, out_features: int, in_features: int, rank: int) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.B @ self.A


def _targets(model: TinyLM) -> list[tuple[nn.Module, str]]:
    out: list[tuple[nn.Module, str]] = []
    for block in model.blocks:
        assert isinstance(block, nn.TransformerEncoderLayer)
        out += [
            (block.self_attn, "in_proj_weight"),
            (block.self_attn.out_proj, "weight"),
            (block.linear1, "weight"),
            (block.linear2, "weight"),
        ]
    return out


def add_lora(model: TinyLM, max_fraction: float = 0.01) -> int:
    """Freeze ``model`` and add adapters of the largest rank (at least 1) that keeps the trainable
    parameters under ``max_fraction`` of all of them; returns the rank."""
    targets = _targets(model)
    base = sum(p.numel() for p in model.parameters())
    per_rank = sum(sum(getattr(m, name).shape) for m, name in targets)
    rank = 1
    while per_rank * (rank + 1) < max_fraction * (base + per_rank * (rank + 1)):
        rank += 1
    model.requires_grad_(False)
    for module, name in targets:
        out_features, in_features = getattr(module, name).shape
        parametrize.register_parametrization(
            module, name, LowRankDelta(out_features, in_features, rank)
        )
    return rank
