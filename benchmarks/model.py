"""The workload: a small decoder-only transformer LM trained with AdamW on random tokens.

Real forward/backward/optimizer steps, so parameters and optimizer moments evolve the way they do
in training (not synthetic noise). The LM head is tied to the token embedding (as in GPT-2), so
the state dict holds each tensor once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    ff: int
    seq: int
    batch: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Full: ~17.5M parameters -> ~210 MB of fp32 state (params + AdamW exp_avg + exp_avg_sq).
FULL = ModelConfig(vocab=8192, d_model=384, layers=8, heads=6, ff=1536, seq=128, batch=4)
# Quick: ~0.5M parameters -> ~6 MB of fp32 state; seconds per scenario.
QUICK = ModelConfig(vocab=1024, d_model=128, layers=2, heads=4, ff=512, seq=32, batch=4)


class TinyLM(nn.Module):
    """Token + position embedding, pre-norm ``nn.TransformerEncoderLayer`` blocks with a causal
    mask, final LayerNorm, LM head tied to the embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.d_model,
                cfg.heads,
                cfg.ff,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        mask = torch.triu(torch.full((cfg.seq, cfg.seq), float("-inf")), diagonal=1)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        mask = self.causal_mask[:seq, :seq].to(h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.linear(self.norm(h), self.embed.weight)


def param_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class RandomTokens:
    """Batches of uniformly random tokens from a seeded generator (reproducible)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self) -> torch.Tensor:
        return torch.randint(
            0, self.cfg.vocab, (self.cfg.batch, self.cfg.seq + 1), generator=self.gen
        )


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One next-token-prediction step; returns the loss."""
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
