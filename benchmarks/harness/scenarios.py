"""Scenarios: how the model is set up and trained between checkpoints.

A scenario is a function ``(Params) -> Workload`` registered with ``@scenario``. The runner
trains the workload for ``workload.steps_before(i)`` steps before checkpoint ``i`` and saves
``workload.state(step)`` with every system. Adding one is a new function here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.harness.lora import add_lora
from benchmarks.harness.model import (
    FULL_EMBEDDING,
    BagClassifier,
    EmbeddingConfig,
    ModelConfig,
    RandomTokens,
    TinyLM,
    Trainable,
    param_count,
    train_step,
)


@dataclass(frozen=True)
class Params:
    """What every scenario is built from."""

    model: ModelConfig
    embedding: EmbeddingConfig = FULL_EMBEDDING  # the sparse_embedding scenario's model
    interval: int = 10  # training steps between checkpoints
    seed: int = 0
    lr: float = 3e-4  # constant AdamW learning rate (pre-training-like)
    weight_decay: float = 0.01


@dataclass
class Workload:
    model: Trainable
    optimizer: torch.optim.Optimizer
    data: RandomTokens
    interval: int  # training steps between checkpoints
    # Training steps before checkpoint ``i`` (default: ``interval`` every time).
    schedule: Callable[[int, int], int] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def steps_before(self, checkpoint: int) -> int:
        if self.schedule is None:
            return self.interval
        return self.schedule(checkpoint, self.interval)

    def train(self, steps: int) -> float | None:
        self.model.train()
        loss = None
        for _ in range(steps):
            loss = train_step(self.model, self.optimizer, self.data())
        return loss

    def state(self, step: int) -> dict[str, Any]:
        """A Lightning-like checkpoint dict (what ``trainer.save_checkpoint`` would hold)."""
        return {
            "epoch": 0,
            "global_step": step,
            "state_dict": self.model.state_dict(),
            "optimizer_states": [self.optimizer.state_dict()],
            "rng": {"torch": torch.get_rng_state(), "data": self.data.gen.get_state()},
        }


ScenarioFn = Callable[[Params], Workload]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    build: ScenarioFn


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, description: str) -> Callable[[ScenarioFn], ScenarioFn]:
    def register(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS[name] = Scenario(name, description, fn)
        return fn

    return register


def _seed(p: Params) -> None:
    """Seed every global RNG that a checkpoint may record (Accelerate saves Python's and
    NumPy's too), so that byte counts are the same from run to run."""
    random.seed(p.seed)
    np.random.seed(p.seed)
    torch.manual_seed(p.seed)


def _adamw(params: Any, p: Params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=p.lr, weight_decay=p.weight_decay)


def _info(model: nn.Module) -> dict[str, Any]:
    total, trainable = param_count(model), param_count(model, trainable_only=True)
    return {
        "params": total,
        "trainable_params": trainable,
        "trainable_fraction": trainable / total if total else 0.0,
    }


def _dense(p: Params, dtype: torch.dtype) -> Workload:
    """Every parameter trained with AdamW, weights in ``dtype``."""
    _seed(p)
    model = TinyLM(p.model).to(dtype)
    return Workload(
        model,
        _adamw(model.parameters(), p),
        RandomTokens.for_lm(p.model, p.seed),
        p.interval,
        info=_info(model),
    )


@scenario("dense_fp32", "all parameters trained, fp32 weights and AdamW state")
def dense_fp32(p: Params) -> Workload:
    return _dense(p, torch.float32)


@scenario("bf16", "all parameters trained, bf16 weights (AdamW state in bf16 as it comes)")
def bf16(p: Params) -> Workload:
    return _dense(p, torch.bfloat16)


# Training steps before the first checkpoint of the ``_trained`` scenarios, in intervals. From a
# random init, the first few hundred AdamW steps are a transient (``exp_avg_sq`` grows from zero,
# the weights move fast): most of a long run's checkpoints come after it.
WARMUP_INTERVALS = 40


def _trained(work: Workload) -> Workload:
    """``work`` trained ``WARMUP_INTERVALS`` intervals before its first checkpoint."""
    work.schedule = lambda checkpoint, k: WARMUP_INTERVALS * k if checkpoint == 0 else k
    work.info["warmup_steps"] = WARMUP_INTERVALS * work.interval
    return work


@scenario(
    "dense_fp32_trained",
    f"dense_fp32 past the start of training: {WARMUP_INTERVALS} intervals of steps before the "
    "first checkpoint (the steady state of a long run)",
)
def dense_fp32_trained(p: Params) -> Workload:
    return _trained(dense_fp32(p))


@scenario(
    "bf16_trained",
    f"bf16 past the start of training: {WARMUP_INTERVALS} intervals of steps before the first "
    "checkpoint",
)
def bf16_trained(p: Params) -> Workload:
    return _trained(bf16(p))


def freeze_bottom(model: nn.Module, frozen_fraction: float) -> None:
    """Fine-tune the top only: keep the top-most parameters trainable (final norm, then the last
    block's tensors, top down, contiguously) as long as adding the next one brings the trainable
    count closer to ``1 - frozen_fraction`` of the total; freeze everything below
    (``requires_grad=False``)."""
    params = list(model.parameters())
    target = (1.0 - frozen_fraction) * sum(p.numel() for p in params)
    trainable, freezing = 0, False
    for p in reversed(params):
        freezing = freezing or abs(trainable + p.numel() - target) > abs(trainable - target)
        if freezing:
            p.requires_grad_(False)
        else:
            trainable += p.numel()


@scenario("frozen90", "~90% of parameters frozen (bottom), top trained; full model in the state")
def frozen90(p: Params) -> Workload:
    _seed(p)
    model = TinyLM(p.model)
    freeze_bottom(model, 0.90)
    optimizer = _adamw([t for t in model.parameters() if t.requires_grad], p)
    return Workload(
        model, optimizer, RandomTokens.for_lm(p.model, p.seed), p.interval, info=_info(model)
    )


@scenario("unchanged", "dense fp32; trained before the first checkpoint only, then re-saved")
def unchanged(p: Params) -> Workload:
    work = dense_fp32(p)
    work.schedule = lambda checkpoint, k: k if checkpoint == 0 else 0
    return work


@scenario("lora", "frozen base + LoRA adapters (<1% trainable) on attention and MLP linears")
def lora(p: Params) -> Workload:
    _seed(p)
    model = TinyLM(p.model)
    rank = add_lora(model, max_fraction=0.01)
    optimizer = _adamw([t for t in model.parameters() if t.requires_grad], p)
    return Workload(
        model,
        optimizer,
        RandomTokens.for_lm(p.model, p.seed),
        p.interval,
        info={**_info(model), "lora_rank": rank},
    )


ADAGRAD_LR = 0.05


@scenario(
    "sparse_embedding",
    "embedding-heavy bag classifier, sparse gradients + Adagrad: a step changes only the rows "
    "(and their optimizer state) of its batch's ids",
)
def sparse_embedding(p: Params) -> Workload:
    _seed(p)
    # Explicitly keep torch's default (no invariant checks on the sparse gradients Adagrad builds);
    # silences its "implicitly disabled" warning.
    torch.sparse.check_sparse_tensor_invariants.disable()
    model = BagClassifier(p.embedding)
    return Workload(
        model,
        torch.optim.Adagrad(model.parameters(), lr=ADAGRAD_LR),
        RandomTokens.for_bags(p.embedding, p.seed),
        p.interval,
        info=_info(model),
    )
