"""What a preemption notice does (:class:`PreemptionConfig`, an adapter's ``preemption=``) and
which signals give one: the configured ones, else SIGTERM and SIGINT, plus SLURM's requeue
signal under SLURM. The mechanism that acts on them: :mod:`.preemption`."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_incremental.core.errors import ConfigError

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a process ended by SIGTERM reports
DEFAULT_GRACE_S = 25.0  # inside torchrun's and Kubernetes' 30 s between SIGTERM and SIGKILL

def slurm_requeue_signal(environ: Mapping[str, str] | None = None) -> int | None:
    """SLURM's requeue signal for this job (``--signal=USR1@90``: SIGUSR1), when running under
    SLURM (``SLURM_JOB_ID``); None otherwise. ``LI_SLURM_SIGNAL`` names another one."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    return _signal_number(env.get("LI_SLURM_SIGNAL", "SIGUSR1"))


def _signal_number(name: str | int) -> int:
    if isinstance(name, int) and not isinstance(name, bool):
        return int(signal.Signals(name))
    if isinstance(name, str):
        key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        if key in signal.Signals.__members__:
            return int(signal.Signals[key])
    raise ConfigError(f"not a signal: {name!r} (e.g. 'SIGTERM', 'SIGUSR1' or a number)")


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """How a preemption notice is used.

    Attributes:
        enabled: handle preemption at all; False leaves every signal as it was.
        signals: the signals that ask for a last checkpoint (names or numbers); None: SIGTERM
            and SIGINT (which ``torchrun``'s agent forwards as it receives them), plus SLURM's
            requeue signal under SLURM.
        grace_s: seconds the launcher leaves between the notice and SIGKILL; a run whose saves
            are expected to take longer is warned at its first save.
        exit_code: what the process exits with once the last checkpoint committed.
        requeue: under SLURM, requeue the job (``scontrol requeue``) after the commit; None:
            when the job was started with SLURM's auto-requeue (``SLURM_JOB_ID`` set and the
            adapter's cluster environment asks for it).
    """

    enabled: bool = True
    signals: tuple[str | int, ...] | None = None
    grace_s: float = DEFAULT_GRACE_S
    exit_code: int = EXIT_PREEMPTED
    requeue: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"preemption enabled must be True or False, got {self.enabled!r}")
        if self.signals is not None:
            for name in self.signals:
                _signal_number(name)
        grace = self.grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise ConfigError(f"grace_s must be a positive number of seconds, got {grace!r}")
        code = self.exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 0 < code < 256:
            raise ConfigError(f"exit_code must be an int in 1..255, got {code!r}")

    @classmethod
    def of(cls, value: object) -> PreemptionConfig:
        """An adapter's ``preemption`` argument as a config (True/False: the defaults, on/off).

        Raises:
            TypeError: neither a bool nor a :class:`PreemptionConfig`.
        """
        if isinstance(value, bool):
            return cls(enabled=value)
        if not isinstance(value, PreemptionConfig):
            raise TypeError(f"preemption must be a bool or a PreemptionConfig, got {value!r}")
        return value

    def signal_numbers(self, environ: Mapping[str, str] | None = None) -> list[int]:
        if self.signals is not None:
            return sorted({_signal_number(s) for s in self.signals})
        found = {int(signal.SIGTERM), int(signal.SIGINT)}
        slurm = slurm_requeue_signal(environ)
        if slurm is not None:
            found.add(slurm)
        return sorted(found)
