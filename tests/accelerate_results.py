"""Comparing the final results of the Accelerate launch jobs, bit for bit."""

from __future__ import annotations

from typing import Any

import torch


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same step, bit-identical weights and optimizer state."""
    assert a["step"] == b["step"]
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    for pid, entry in a["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][name]), (pid, name)
