"""The runtime kit both adapters share: the coordinator's outcome on every rank, the recovery
options, back-pressure, the exit-time drain, random state and the data loaders' generators."""

from __future__ import annotations

import logging
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from lightning_incremental.core import (
    CheckpointError,
    ConfigError,
    StorageError,
    StoreNotWritableError,
    WriterLeaseError,
)
from lightning_incremental.core.save import at_exit
from lightning_incremental.runtime import (
    CoordinatorError,
    Outcome,
    RecoveryOptions,
    WatchdogConfig,
    coordinated,
)
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.cluster.coordinate import Message
from lightning_incremental.runtime.policy.backpressure import wait_for_room
from lightning_incremental.runtime.state import data_position, rng

# ---------------------------------------------------------------- the coordinator's outcome


def _two_ranks(action: Any, what: str = "open the store") -> tuple[Outcome[Any], Message, Any]:
    """``action`` as rank 0 runs it, the message rank 0 broadcasts, and what rank 1 gets from
    ``coordinated`` (its value or error) over a broadcast that carries rank 0's message."""
    mine = Outcome.of(action)
    message = mine.message()

    def broadcast_to_1(sent: Message, src: int) -> Message:
        assert src == 0 and sent == (None, None)  # rank 1 sends nothing of its own
        return message

    try:
        received: Any = coordinated(
            action, what=what, is_coordinator=False, broadcast=broadcast_to_1
        )
    except CoordinatorError as exc:
        received = exc
    return mine, message, received


def test_every_rank_gets_the_coordinators_value() -> None:
    calls: list[int] = []

    def act() -> tuple[int, str]:
        calls.append(1)
        return 7, "g3"

    mine, message, received = _two_ranks(act)
    assert mine.value == (7, "g3") and message == ((7, "g3"), None)
    assert received == (7, "g3")
    assert calls == [1], "only the coordinator runs the action"


def test_the_coordinator_raises_its_own_error_the_others_a_coordinator_error() -> None:
    def act() -> int:
        raise StorageError("disk full")

    with pytest.raises(StorageError, match="disk full"):
        coordinated(act, what="open s3://b/run", is_coordinator=True, broadcast=lambda m, s: m)
    _, message, received = _two_ranks(act, "open s3://b/run")
    assert message == (None, "StorageError: disk full")
    assert isinstance(received, CoordinatorError)
    assert isinstance(received, CheckpointError) and isinstance(received, RuntimeError)
    assert str(received) == "rank 0 could not open s3://b/run: StorageError: disk full"
    assert (received.rank, received.what, received.cause) == (
        0,
        "open s3://b/run",
        "StorageError: disk full",
    )


def test_a_missing_file_is_a_file_not_found_error_on_every_rank() -> None:
    """Code that catches ``FileNotFoundError`` around a framework's load (as Lightning's
    ``TorchCheckpointIO`` raises on every rank) keeps working on the other ranks."""

    def act() -> int:
        raise FileNotFoundError("Checkpoint file not found: /runs/missing.ckpt")

    _, _, received = _two_ranks(act, "load /runs/missing.ckpt")
    assert isinstance(received, FileNotFoundError) and isinstance(received, CoordinatorError)
    assert str(received) == (
        "rank 0 could not load /runs/missing.ckpt: FileNotFoundError: Checkpoint file not "
        "found: /runs/missing.ckpt"
    )
    copy = pickle.loads(pickle.dumps(received))
    assert type(copy) is type(received) and str(copy) == str(received)
    _, _, other = _two_ranks(lambda: 1 / 0, "load x")
    assert not isinstance(other, FileNotFoundError)


@pytest.mark.parametrize("kind", [WriterLeaseError, StoreNotWritableError])
def test_a_refused_writer_is_refused_alike_on_every_rank(kind: type[Exception]) -> None:
    """A run's start as a writer (``runtime.writing``): another writer, or a store that cannot
    be written, is an error of the same type on the other ranks, caught as such."""

    def act() -> int:
        raise kind("s3://b/run is being written by another process: host h pid 7")

    _, _, received = _two_ranks(act, "start writing the checkpoint store s3://b/run")
    assert isinstance(received, kind) and isinstance(received, CoordinatorError)
    assert "host h pid 7" in str(received)
    copy = pickle.loads(pickle.dumps(received))
    assert type(copy) is type(received) and str(copy) == str(received)


def test_a_coordinator_error_pickles() -> None:
    error = CoordinatorError(2, "load step 5", "CorruptCheckpointError: bad hash")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is CoordinatorError and str(copy) == str(error)
    assert (copy.rank, copy.what, copy.cause) == (2, "load step 5", error.cause)


def test_alone_the_coordinator_needs_no_process_group() -> None:
    assert not collectives.is_distributed()
    assert coordinated(lambda: 3, what="x", is_coordinator=True) == 3
    assert collectives.gather({"a": 1}) == [{"a": 1}] == collectives.gather_to({"a": 1})
    assert collectives.broadcast("mine") == "mine"
    assert (collectives.rank(), collectives.world_size()) == (0, 1)
    collectives.barrier()


def test_keyboard_interrupt_is_not_an_outcome() -> None:
    def act() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Outcome.of(act)


# ---------------------------------------------------------------- recovery options


def test_recovery_options_defaults_are_the_adapters() -> None:
    options = RecoveryOptions()
    assert options.watchdog_config == WatchdogConfig()
    assert options.replica_check == "warn" and options.max_consecutive_failures == 3
    assert not options.watchdog_on(1) and options.watchdog_on(2)
    assert RecoveryOptions(watchdog=True).watchdog_on(1)
    assert not RecoveryOptions(watchdog=False).watchdog_on(8)
    assert (
        RecoveryOptions(watchdog=False).start_watchdog(rank=0, world_size=2, generation=0) is None
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"watchdog": "yes"}, TypeError, "watchdog must be True, False or None"),
        ({"heartbeat_timeout": 1.0}, ConfigError, "at least 3 heartbeat intervals"),
        ({"progress_timeout": -1}, ConfigError, "progress_timeout must be a positive"),
        ({"replica_check": "fix"}, ConfigError, "replica_check must be one of"),
        ({"max_consecutive_failures": 0}, ConfigError, "max_consecutive_failures must be >= 1"),
        ({"max_consecutive_failures": 1.0}, TypeError, "max_consecutive_failures must be an int"),
    ],
)
def test_recovery_options_are_validated(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RecoveryOptions(**kwargs)


def test_recovery_or_the_individual_arguments_not_both() -> None:
    given = RecoveryOptions(replica_check="stop", heartbeat_interval=1.0, heartbeat_timeout=10.0)
    assert RecoveryOptions.resolve(given, **_defaults()) is given
    built = RecoveryOptions.resolve(None, **{**_defaults(), "replica_check": "off"})
    assert built == RecoveryOptions(replica_check="off")
    with pytest.raises(ConfigError, match=r"either recovery=.* or max_consecutive_failures, "):
        RecoveryOptions.resolve(given, **{**_defaults(), "max_consecutive_failures": 1})
    with pytest.raises(TypeError, match="recovery must be a RecoveryOptions"):
        RecoveryOptions.resolve({"watchdog": True}, **_defaults())


def _defaults() -> dict[str, Any]:
    return {
        "watchdog": None,
        "heartbeat_interval": 5.0,
        "heartbeat_timeout": 60.0,
        "progress_timeout": 900.0,
        "replica_check": "warn",
        "max_consecutive_failures": 3,
    }


def test_both_adapters_take_recovery_options(tmp_path: Any) -> None:
    from lightning_incremental import IncrementalCheckpoint

    options = RecoveryOptions(replica_check="repair", max_consecutive_failures=2)
    callback = IncrementalCheckpoint(tmp_path / "a", recovery=options)
    assert callback.recovery is options
    assert (callback.replica_check, callback.max_consecutive_failures) == ("repair", 2)
    with pytest.raises(ConfigError, match="not both"):
        IncrementalCheckpoint(tmp_path / "a", recovery=options, watchdog=True)
    from accelerate_incremental._arguments import check_arguments

    assert check_arguments(str(tmp_path / "b"), recovery=options) is options
    with pytest.raises(ConfigError, match="not both"):
        check_arguments(str(tmp_path / "b"), recovery=options, replica_check="stop")


# ---------------------------------------------------------------- back-pressure


class _Pending:
    def __init__(self, name: str, waited: list[str]) -> None:
        self.name, self.waited = name, waited

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.waited.append(self.name)
        return StorageError(self.name)  # returned, never raised


@pytest.mark.parametrize(
    ("pending", "limit", "waited"),
    [(0, 1, []), (1, 1, ["0"]), (3, 1, ["0", "1", "2"]), (3, 2, ["0", "1"]), (1, 2, [])],
)
def test_wait_for_room_waits_for_the_oldest(pending: int, limit: int, waited: list[str]) -> None:
    order: list[str] = []
    wait_for_room([_Pending(str(i), order) for i in range(pending)], limit)
    assert order == waited


# ---------------------------------------------------------------- exit-time drain


class _Owner:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry of its own, whose interpreter hook is not installed."""
    monkeypatch.setattr(at_exit, "_owners", {})
    monkeypatch.setattr(at_exit, "_hooked", True)


def test_drains_run_newest_registration_first(drains: None, caplog: Any) -> None:
    ran: list[str] = []
    first, second, gone = _Owner("first"), _Owner("second"), _Owner("gone")
    for owner in (first, gone, second):
        at_exit.drain_at_exit(owner, lambda o: ran.append(o.name))
    at_exit.drain_at_exit(first, lambda o: ran.append(o.name + " again"))  # now the newest
    del gone  # a dead owner is forgotten

    def broken(owner: _Owner) -> None:
        raise StorageError("lost")

    failing = _Owner("failing")
    at_exit.drain_at_exit(failing, broken)
    with caplog.at_level(logging.ERROR, logger="lightning_incremental"):
        at_exit._drain_all()
    assert ran == ["first again", "second"]
    assert "failed while the process was exiting: lost" in caplog.text


# ---------------------------------------------------------------- random state, generators


def test_random_state_round_trips() -> None:
    state = rng.capture()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    rng.restore(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]
    with pytest.raises(ValueError, match="not a captured random state"):
        rng.restore({"torch": state["torch"]})


def test_generators_are_found_by_path_and_put_back() -> None:
    sampler_gen, loader_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    data = list(range(10))
    loader = DataLoader(data, sampler=RandomSampler(data, generator=sampler_gen))
    loader.generator = loader_gen
    found = data_position.find_generators(loader, follow=("sampler",), max_depth=2)
    assert found == {"generator": loader_gen, "sampler.generator": sampler_gen}
    prefixed = data_position.find_generators(loader, path="0", follow=("sampler",), max_depth=2)
    assert sorted(prefixed) == ["0.generator", "0.sampler.generator"]
    shallow = data_position.find_generators(loader, follow=("sampler",), max_depth=0)
    assert list(shallow) == ["generator"]
    refused = data_position.find_generators(
        loader, follow=("sampler",), max_depth=2, accept=lambda value: False
    )
    assert list(refused) == ["generator"]

    saved = data_position.generator_states(found)
    order = list(loader.sampler)
    assert list(loader.sampler) != order  # the generator moved on
    assert data_position.set_generator_states(
        found, {**saved, "gone.generator": saved["generator"]}
    ) == ["gone.generator"]
    assert list(loader.sampler) == order


# ---------------------------------------------------------------- two real processes


def _two_process_job(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        seen: dict[str, Any] = {"gathered": collectives.gather(rank * 10)}
        seen["to_zero"] = collectives.gather_to({"rank": rank})
        seen["value"] = coordinated(lambda: ("step", 4), what="pick", is_coordinator=rank == 0)

        def fail() -> None:
            raise StorageError("no space left")

        try:
            coordinated(fail, what="open file:///x", is_coordinator=rank == 0)
        except CheckpointError as exc:
            seen["error"] = (type(exc).__name__, str(exc))
        collectives.barrier()
        torch.save(seen, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_learn_the_coordinators_outcome(tmp_path: Any) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "seen")
    torch.multiprocessing.spawn(_two_process_job, args=(init, out), nprocs=2)
    zero, one = (torch.load(f"{out}.{r}") for r in (0, 1))
    assert zero["gathered"] == one["gathered"] == [0, 10]
    assert zero["to_zero"] == [{"rank": 0}, {"rank": 1}] and one["to_zero"] is None
    assert zero["value"] == one["value"] == ("step", 4)
    assert zero["error"] == ("StorageError", "no space left")
    assert one["error"] == (
        "CoordinatorError",
        "rank 0 could not open file:///x: StorageError: no space left",
    )
