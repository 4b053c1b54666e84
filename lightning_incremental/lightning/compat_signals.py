"""Lightning's signal handling, part of :mod:`.compat` (every use of a Lightning internal; this
module holds those of its SIGTERM flag and signal connector, re-exported there)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def is_sigterm(exception: BaseException) -> bool:
    """Whether ``exception`` is Lightning's ``SIGTERMException`` (raised at a batch boundary
    after the trainer's SIGTERM handler ran)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(exception, SIGTERMException)


def received_sigterm(trainer: pl.Trainer) -> bool:
    """Whether the trainer's own SIGTERM handler ran in this process (before the callback's
    was armed: while it is, the flag is set only by :func:`stop_as_on_sigterm`)."""
    return bool(getattr(trainer, "received_sigterm", False))


def stop_as_on_sigterm(trainer: pl.Trainer) -> None:
    """Make the trainer stop as after a SIGTERM: its loops raise ``SIGTERMException`` at the next
    check (2.5 and 2.6: the signal connector's ``received_sigterm``)."""
    _set_received_sigterm(trainer, True)


def hold_sigterm(trainer: pl.Trainer) -> None:
    """Undo what the trainer's SIGTERM handler recorded (until :func:`stop_as_on_sigterm`), so
    its evaluation loop does not stop at the next batch."""
    _set_received_sigterm(trainer, False)


def _set_received_sigterm(trainer: pl.Trainer, value: bool) -> None:
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None:
        connector.received_sigterm = value


# --- Lightning's signal handlers, while the callback's preemption handling is armed -----------
#
# What ``Trainer.fit`` installs (``_SignalConnector.register_signal_handlers``, before the
# callbacks' ``on_train_start``), in the releases we support:
#
# * SIGTERM: ``_sigterm_notifier_fn`` (then the handler found before, if any). In every 2.5 and
#   2.6 release it logs, on the first delivery makes the strategy's launcher (when Lightning
#   started the processes itself) send the signal on to its children, and sets the connector's
#   ``received_sigterm``. From 2.5.2 on (and in 2.6) it also runs ``dist.broadcast`` under DDP —
#   a collective inside a signal handler, which mismatches the ranks' collectives when the
#   signal lands inside another one (a second delivery during the callback's agreement) — and
#   the training loop broadcasts rank 0's ``received_sigterm`` at every batch's start, raising
#   ``SIGTERMException`` on every rank once it is set: a stop without the callback's checkpoint.
#   2.5.0 and 2.5.1 do neither; they stop each rank on its own flag.
# * Under SLURM with ``auto_requeue``: SIGTERM also gets ``_sigterm_handler_fn`` (it only logs),
#   and the requeue signal (SIGUSR1) ``_slurm_sigusr_handler_fn``, which saves a checkpoint
#   through ``trainer.save_checkpoint`` (collectives under DDP) and runs ``scontrol requeue``,
#   inside the handler.
#
# So while armed, the callback's handler calls :func:`signal_handler_without_collectives` in
# place of Lightning's: the launcher's forwarding is kept; the flag is honoured as a request of
# the callback's own (its handler records every delivery) and set on every rank at once when
# the ranks agree to stop (:func:`stop_as_on_sigterm`), so the per-batch broadcast sees it only
# then; the SLURM checkpoint and requeue are the callback's, after the commit
# (:func:`slurm_auto_requeue`); a handler of the user's that Lightning composed is called as
# Lightning would.


def signal_handler_without_collectives(trainer: pl.Trainer, handler: Any) -> Any:
    """What the callback's signal handler calls in place of ``handler`` (the one installed
    before it): Lightning's composed handler without its collective, checkpoint and logging
    (see the notes above); any other handler itself."""
    from lightning.pytorch.trainer.connectors.signal_connector import (
        _HandlersCompose,
        _SignalConnector,
    )

    if not isinstance(handler, _HandlersCompose):
        return handler
    connector = getattr(trainer, "_signal_connector", None)
    dropped = (_SignalConnector._sigterm_handler_fn, _SignalConnector._slurm_sigusr_handler_fn)
    kept: list[Any] = []
    forwarded: list[bool] = []

    def forward(signum: int, frame: Any) -> None:
        if not forwarded:  # as Lightning: the launcher forwards the first delivery only
            forwarded.append(True)
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # sends the signal on to its processes (no waiting)

    for part in handler.signal_handlers:
        function = getattr(part, "__func__", None)
        if getattr(part, "__self__", None) is connector and connector is not None:
            if function is _SignalConnector._sigterm_notifier_fn:
                kept.append(forward)
                continue
            if function in dropped:
                continue
        kept.append(part)
    return _HandlersCompose(kept)


def ignore_signals_after_fit(trainer: pl.Trainer, signums: list[int]) -> None:
    """Make Lightning's teardown leave ``signums`` ignored instead of putting back the handlers
    it found at the fit's start (the connector's ``_original_handlers``, 2.5 and 2.6)."""
    import signal

    connector = getattr(trainer, "_signal_connector", None)
    originals = getattr(connector, "_original_handlers", None)
    if isinstance(originals, dict):
        for signum in signums:
            originals[signal.Signals(signum)] = signal.SIG_IGN


def slurm_auto_requeue(trainer: pl.Trainer) -> bool:
    """Whether the trainer runs under Lightning's SLURM environment with ``auto_requeue`` (its
    handler would have requeued the job at the requeue signal)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer._accelerator_connector.cluster_environment
    return isinstance(environment, SLURMEnvironment) and bool(environment.auto_requeue)
