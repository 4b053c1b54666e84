"""The exit-time drain's registry of owners (:mod:`lightning_incremental.core.save.at_exit`)."""

from __future__ import annotations

import gc
import threading

from lightning_incremental.core.save import at_exit


class Owner:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the garbage collector frees it


def test_registering_while_the_collector_frees_other_owners_does_not_deadlock() -> None:
    """Owners freed by the garbage collector in the middle of a registration (any allocation
    can run it) must not need the registry's lock: this used to hang forever."""
    done = threading.Event()

    def register_many() -> None:
        gc.set_threshold(1)  # collect at almost every allocation
        try:
            for _ in range(2000):
                at_exit.drain_at_exit(Owner(), lambda owner: None)
        finally:
            gc.set_threshold(700, 10, 10)
            done.set()

    thread = threading.Thread(target=register_many, daemon=True)
    thread.start()
    assert done.wait(60), "registration deadlocked"


def test_dead_owners_are_dropped_and_live_ones_drained_newest_first() -> None:
    drained: list[str] = []
    first, second = Owner(), Owner()
    at_exit.drain_at_exit(first, lambda owner: drained.append("first"))
    at_exit.drain_at_exit(second, lambda owner: drained.append("second"))
    gone = Owner()
    at_exit.drain_at_exit(gone, lambda owner: drained.append("gone"))
    del gone
    gc.collect()
    keeper = Owner()
    gc.disable()
    try:
        at_exit.drain_at_exit(keeper, lambda owner: None)  # purges what died
        live = [ref() for ref, _ in at_exit._owners.values()]
    finally:
        gc.enable()
    assert None not in live
    assert first in live and second in live
    at_exit._drain_all()
    assert drained[-2:] == ["second", "first"] and "gone" not in drained
    del first, second
