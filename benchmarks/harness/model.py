"""The workload models: a small decoder-only transformer LM trained on random tokens, and an
embedding-heavy bag-of-ids classifier with a sparse-gradient embedding table.

Real forward/backward/optimizer steps, so parameters and optimizer moments evolve the way they do
in training (not synthetic noise). The LM head is tied to the token embedding (as in GPT-2), so
the state dict holds each tensor once. The jobs that train the LM in a training loop take its
loss, a run's batches and its LightningModule from here too.
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


@dataclass(frozen=True)
class EmbeddingConfig:
    vocab: int  # rows of the embedding table
    dim: int
    bag: int  # ids per example (mean-pooled)
    hidden: int
    classes: int
    batch: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Full: a 100k x 128 table (51 MB fp32, as much again of Adagrad state); 512 ids per step touch
# ~0.5% of the rows, ~5% over a 10-step interval.
FULL_EMBEDDING = EmbeddingConfig(vocab=100_000, dim=128, bag=32, hidden=256, classes=64, batch=16)
QUICK_EMBEDDING = EmbeddingConfig(vocab=10_000, dim=32, bag=8, hidden=64, classes=16, batch=8)


class Trainable(nn.Module):
    """A model that knows its training loss on a batch of ids."""

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TinyLM(Trainable):
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

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token prediction: ``batch`` is ``(batch, seq + 1)`` ids."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )


class BagClassifier(Trainable):
    """Mean of the embeddings of a bag of ids, then a small MLP; the label is a function of the
    first id (learnable). The table has ``sparse=True``: its gradient holds only the rows of the
    batch's ids, so a sparse-aware optimizer leaves every other row (and its state) untouched."""

    def __init__(self, cfg: EmbeddingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim, sparse=True)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.classes)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids).mean(dim=1))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(batch), batch[:, 0] % self.cfg.classes)


def param_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class RandomTokens:
    """Batches of uniformly random ids in ``[0, high)`` from a seeded generator (reproducible)."""

    def __init__(self, high: int, shape: tuple[int, ...], seed: int = 0) -> None:
        self.high = high
        self.shape = shape
        self.gen = torch.Generator().manual_seed(seed)

    @classmethod
    def for_lm(cls, cfg: ModelConfig, seed: int = 0) -> RandomTokens:
        return cls(cfg.vocab, (cfg.batch, cfg.seq + 1), seed)

    @classmethod
    def for_bags(cls, cfg: EmbeddingConfig, seed: int = 0) -> RandomTokens:
        return cls(cfg.vocab, (cfg.batch, cfg.bag), seed)

    def __call__(self) -> torch.Tensor:
        return torch.randint(0, self.high, self.shape, generator=self.gen)


def train_step(model: Trainable, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One training step; returns the loss."""
    loss = model.loss(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def token_data(cfg: ModelConfig, batches: int) -> list[torch.Tensor]:
    """``batches`` batches of random sequences, one epoch, in order."""
    tokens = RandomTokens.for_lm(cfg)
    return [row for _ in range(batches) for row in tokens()]


def lightning_lm(cfg: ModelConfig, data: Any) -> Any:
    """A LightningModule training :class:`TinyLM` with AdamW over ``data`` (batches of
    ``cfg.batch``)."""
    import lightning.pytorch as L

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyLM(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model.loss(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=cfg.batch)

    return LM()
