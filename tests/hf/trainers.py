"""A tiny ``transformers.Trainer`` built in the test process: GPT-2 from a config (no download),
random token ids, CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tiny_trainer(output_dir: Path, eval_dataset: Any = None, **arguments: Any) -> Any:
    """A Trainer over a 2-layer GPT-2 and 32 random sequences (and ``eval_dataset``);
    ``arguments`` override the ``TrainingArguments``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=8)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "max_steps": 10,
        "save_strategy": "steps",
        "save_steps": 5,
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "logging_steps": 1000,
        **arguments,
    }
    return Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=data,
        eval_dataset=eval_dataset,
    )


def weights(trainer: Any) -> dict[str, Any]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}
