"""Retry policy for storage requests: bounded attempts, exponential backoff with jitter.

Object stores fail transiently (HTTP 500/503, throttling, timeouts, reset connections). A
request that failed that way is tried again after a pause that doubles each time, up to a cap,
with random jitter so that many ranks retrying at once do not hit the store in lockstep. The
number of attempts is bounded: a store that keeps failing fails that write with a clear error
instead of hanging the training job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_incremental.core.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a storage request is retried after a transient failure.

    Attributes:
        attempts: tries per request, the first one included (``1``: never retry). Default 5.
        backoff_s: pause before the second try; each later pause doubles. Default 0.2.
        max_backoff_s: the longest pause. Default 5.0.
        jitter: pause a random time between half and all of the computed backoff. Default True.
    """

    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ConfigError(f"attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigError(f"attempts must be >= 1, got {self.attempts}")
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.jitter, bool):
            raise ConfigError(f"jitter must be True or False, got {self.jitter!r}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        base = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(failures - 1, 62))
        return base * (0.5 + random.random() / 2) if self.jitter else base
