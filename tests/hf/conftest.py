"""Every Trainer checkpointer a test creates is closed after it: a Trainer holds its store (and
the store's lease thread) for as long as it lives, and tests that look for this library's
threads left running (tests/lightning) must not see these."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _close_trainer_checkpointers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from accelerate_incremental.trainer import checkpointer as _trainer

    made: list[weakref.ref[Any]] = []  # weak: a test may check that a dropped Trainer goes
    original = _trainer.TrainerCheckpointer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(weakref.ref(self))
        original(self, *args, **kwargs)

    monkeypatch.setattr(_trainer.TrainerCheckpointer, "__init__", init)
    yield
    for ref in made:
        store = getattr(ref(), "store", None)
        if store is not None:
            store.close()
