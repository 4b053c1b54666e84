"""What counts as progress for the watchdog of an
:class:`~accelerate_incremental.IncrementalCheckpointer`, and stopping the watchdog of one dropped
without ``close()``."""

from __future__ import annotations

from typing import Any

from accelerate_incremental import _compat
from lightning_incremental.runtime.cluster.watchdog import Watchdog


def watch_optimizers(
    accelerator: Any, dog: Watchdog | None, watched: set[int], hooks: list[Any]
) -> None:
    """Count every prepared optimizer's step as progress for ``dog`` (whatever loop the script
    runs); ``watched``: the ids of the optimizers already counted; ``hooks``: their hook
    handles, removed at ``close``."""
    if dog is None:
        return
    for opt in _compat.optimizers(accelerator):
        if id(opt) not in watched:
            watched.add(id(opt))
            inner = getattr(opt, "optimizer", opt)
            hooks.append(inner.register_step_post_hook(lambda *_: dog.progress()))


def stop_dropped(dog: Watchdog) -> None:
    """Stop the watchdog of a checkpointer dropped without ``close()``, without joining its
    threads: a finalizer may run on a thread that holds a lock they need to end (logging's, the
    store client's). They see the stop within a heartbeat interval and end alone."""
    dog.stop(timeout=0, finished=False)
