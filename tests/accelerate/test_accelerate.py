"""Single-process unit tests of the Accelerate adapter (no launcher; the multi-process runs are in
test_accelerate_launch.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelerate_incremental
from accelerate_incremental import IncrementalCheckpointer, enable
from accelerate_incremental._flag import settings
from lightning_incremental.core import (
    CheckpointStore,
    ConfigError,
    CorruptCheckpointError,
    StepError,
    UnsupportedValueError,
)


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


@dataclass
class Run:
    acc: Accelerator
    model: Any
    opt: Any
    sched: Any
    loader: Any
    counter: Counter

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(self.model(x), y)
        self.acc.backward(loss)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.counter.value += 1


def make_run(
    hidden: int = 16,
    *,
    generator: bool = True,
    project: ProjectConfiguration | None = None,
    extra_group: bool = False,
) -> Run:
    acc = Accelerator(cpu=True, project_config=project)
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(48, dtype=torch.float32).reshape(12, 4), torch.randn(12, 1))
    gen = torch.Generator().manual_seed(5) if generator else None
    loader = DataLoader(data, batch_size=2, shuffle=True, generator=gen)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.5), nn.Linear(hidden, 1))
    params: Any = model.parameters()
    if extra_group:
        params = [
            {"params": list(model[0].parameters())},
            {"params": list(model[2].parameters())},
        ]
    opt = torch.optim.AdamW(params, lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return Run(acc, model, opt, sched, loader, counter)


def save_once(run: Run, url: str) -> None:
    with IncrementalCheckpointer(run.acc, url) as ckpt:
        ckpt.save(1)


def weights(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in run.acc.unwrap_model(run.model).state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "store"))
    for x, y in run.loader:
        run.step(x, y)
    run.acc.project_configuration.iteration = 4
    ckpt.save(7)
    ckpt.wait()
    saved = weights(run)
    saved_opt = copy.deepcopy(run.opt.state_dict())
    saved_lr = run.sched.get_last_lr()
    after_save = torch.rand(3)

    for x, y in run.loader:  # move every piece of state on
        run.step(x, y)
    run.acc.project_configuration.iteration = 9
    run.acc.step = 123
    assert not same(saved, weights(run))

    assert ckpt.load() == 7
    assert same(saved, weights(run))
    opt_state = run.opt.state_dict()
    for pid, entry in saved_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt_state["state"][pid][key], value), key
    assert run.sched.get_last_lr() == saved_lr
    assert run.counter.value == 6
    assert run.acc.project_configuration.iteration == 4
    assert run.acc.step == 0
    assert torch.equal(torch.rand(3), after_save)  # the process's RNG as at the save
    ckpt.close()


def test_load_from_empty_store_returns_none(tmp_path: Path) -> None:
    run = make_run()
    before = weights(run)
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "empty"))
    assert ckpt.load() is None
    assert same(before, weights(run))


def test_used_before_prepare(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    ckpt = IncrementalCheckpointer(acc, str(tmp_path / "s"))
    with pytest.raises(RuntimeError, match=r"accelerator\.prepare"):
        ckpt.save(1)
    with pytest.raises(RuntimeError, match=r"accelerator\.prepare"):
        ckpt.load()


def test_different_model_layout_names_keys(tmp_path: Path) -> None:
    run = make_run(hidden=16)
    save_once(run, str(tmp_path / "s"))
    other = make_run(hidden=8)
    with pytest.raises(ValueError, match=r"'0.weight': saved \(16, 4\), model \(8, 4\)"):
        IncrementalCheckpointer(other.acc, str(tmp_path / "s")).load()


def test_missing_and_unexpected_keys_named(tmp_path: Path) -> None:
    run = make_run()
    save_once(run, str(tmp_path / "s"))
    acc = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1), nn.Linear(1, 1))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    loader = DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2)
    acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(Counter())
    with pytest.raises(ValueError, match=r"missing keys '3.bias', '3.weight'"):
        IncrementalCheckpointer(acc, str(tmp_path / "s")).load()


def test_different_optimizer_layout(tmp_path: Path) -> None:
    run = make_run()
    save_once(run, str(tmp_path / "s"))
    other = make_run(extra_group=True)
    with pytest.raises(ValueError, match=r"parameter groups of sizes \[4\].*\[2, 2\]"):
        IncrementalCheckpointer(other.acc, str(tmp_path / "s")).load()


def test_different_registered_objects(tmp_path: Path) -> None:
    run = make_run()
    run.acc.register_for_checkpointing(Counter())
    save_once(run, str(tmp_path / "s"))
    other = make_run()
    with pytest.raises(ValueError, match="2 objects registered with register_for_checkpointing"):
        IncrementalCheckpointer(other.acc, str(tmp_path / "s")).load()


def test_unpicklable_state_is_refused(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"thing": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    run = make_run()
    run.acc.register_for_checkpointing(Odd())
    with pytest.raises(UnsupportedValueError, match="custom"):
        save_once(run, str(tmp_path / "s"))


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        (DistributedType.DEEPSPEED, "DeepSpeed's engine owns the partitioned optimizer state"),
        (DistributedType.MEGATRON_LM, "Megatron-LM's engine partitions"),
        (DistributedType.XLA, "XLA devices hold the tensors"),
    ],
)
def test_engines_that_save_their_own_state_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: DistributedType, why: str
) -> None:
    acc = Accelerator(cpu=True)
    monkeypatch.setattr(type(acc), "distributed_type", property(lambda self: kind))
    with pytest.raises(ValueError, match=f"{why}.*Covered: single process, data parallel"):
        IncrementalCheckpointer(acc, str(tmp_path / "s"))


def test_fsdp_asked_for_on_cpu_names_accelerates_silent_ddp_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # Accelerator sets it: restored after
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    assert acc.distributed_type != DistributedType.FSDP  # Accelerate dropped the plugin
    with pytest.warns(UserWarning, match="silently falls back to DDP") as caught:
        IncrementalCheckpointer(acc, str(tmp_path / "s")).close()
    assert f"runs distributed_type {acc.distributed_type.value}" in str(caught[0].message)


def test_no_fallback_warning_without_fsdp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    IncrementalCheckpointer(Accelerator(cpu=True), str(tmp_path / "s")).close()
    assert not [w for w in recwarn if "falls back to DDP" in str(w.message)]


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_state_saved_sharded_and_restored_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_of_one: None
) -> None:
    """The FSDP path on CPU: an FSDP2 model of one process (Accelerate runs FSDP on GPUs only;
    the distributed type is set by hand): sharded state dicts in, the live shards filled."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    monkeypatch.setattr(type(acc), "distributed_type", property(lambda s: DistributedType.FSDP))

    def train(steps: int) -> None:
        for i in range(steps):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()

    def snapshot() -> dict[str, torch.Tensor]:
        state = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        saved = get_optimizer_state_dict(model, opt.optimizer)["state"]
        for name, entry in saved.items():
            for key, value in entry.items():
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                state[f"{name}.{key}"] = whole.clone()
        return state

    train(3)
    with IncrementalCheckpointer(acc, str(tmp_path / "s")) as ckpt:
        ckpt.save(3)
    expected = snapshot()
    train(2)
    assert not same(snapshot(), expected)
    with IncrementalCheckpointer(acc, str(tmp_path / "s")) as ckpt:
        assert ckpt.load() == 3
    assert same(snapshot(), expected)
    saved = CheckpointStore(str(tmp_path / "s")).load(3)
    assert set(saved["optimizers"][0]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_bad_arguments(tmp_path: Path) -> None:
    run = make_run()
    with pytest.raises(TypeError, match=r"accelerate\.Accelerator"):
        IncrementalCheckpointer(object(), str(tmp_path))
    with pytest.raises(TypeError, match="dirpath must be a str"):
        IncrementalCheckpointer(run.acc, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="storage_options"):
        IncrementalCheckpointer(run.acc, str(tmp_path), storage_options=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_n_steps"):
        IncrementalCheckpointer(run.acc, str(tmp_path), every_n_steps=0)
    with pytest.raises(TypeError, match="watchdog must be True, False or None"):
        IncrementalCheckpointer(run.acc, str(tmp_path), watchdog=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 3 heartbeat intervals"):
        IncrementalCheckpointer(run.acc, str(tmp_path), heartbeat_interval=30.0)
    with pytest.raises(ValueError, match="replica_check must be one of"):
        IncrementalCheckpointer(run.acc, str(tmp_path), replica_check="mend")
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"))
    # a bad step is the engine's StepError, as the engine raises it (also a TypeError or a
    # ValueError, as before)
    with pytest.raises(StepError, match="step must be an int") as info:
        ckpt.save("3")  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="step must be an int"):
        ckpt.save(True)
    with pytest.raises(StepError, match=">= 0") as info:
        ckpt.save(-1)
    assert isinstance(info.value, ValueError)
    with pytest.raises(StepError, match="step must be an int"):
        ckpt.maybe_save(2.0)  # type: ignore[arg-type]
    ckpt.save(5)
    with pytest.raises(StepError):
        ckpt.save(5)
    with pytest.raises(ValueError, match="not prepared"):
        next(ckpt.iterate(DataLoader(TensorDataset(torch.zeros(2)))))


def test_every_n_steps_schedule(tmp_path: Path) -> None:
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"), every_n_steps=2)
    saved = [step for step in range(6) if ckpt.maybe_save(step) is not None]
    ckpt.wait()
    assert saved == [2, 4]
    assert ckpt.steps() == [2, 4]
    never = IncrementalCheckpointer(run.acc, str(tmp_path / "t"))
    assert never.maybe_save(4) is None


def test_retention_keep_last_and_total_limit(tmp_path: Path) -> None:
    run = make_run(project=ProjectConfiguration(total_limit=2))
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"))
    for step in range(1, 5):
        x, y = next(iter(run.loader))
        run.step(x, y)
        ckpt.save(step)
        ckpt.wait()
    assert ckpt.steps() == [3, 4]
    latest = weights(run)
    x, y = next(iter(run.loader))
    run.step(x, y)
    assert ckpt.load() == 4
    assert same(latest, weights(run))
    explicit = IncrementalCheckpointer(run.acc, str(tmp_path / "t"), keep_last=3)
    for step in range(1, 6):
        explicit.save(step)
    explicit.wait()
    assert explicit.steps() == [3, 4, 5]


def epoch_batches(
    ckpt: IncrementalCheckpointer, run: Run, stop_after: int | None = None
) -> list[torch.Tensor]:
    seen = []
    for x, y in ckpt.iterate(run.loader):
        run.step(x, y)
        seen.append(x.clone())
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen


@pytest.mark.parametrize("generator", [True, False], ids=["own-generator", "global-rng"])
def test_mid_epoch_resume_is_exact(tmp_path: Path, generator: bool) -> None:
    """Interrupted after 2 of an epoch's 6 batches, a fresh run continues with the same batches
    in the same order and the same random state (dropout), and the next epoch matches too."""
    store = str(tmp_path / "s")
    ref = make_run(generator=generator)
    ckpt = IncrementalCheckpointer(ref.acc, store)
    epoch_batches(ckpt, ref)  # epoch 0
    torch.manual_seed(42)  # the state the epoch-1 order depends on when there is no generator
    it = ckpt.iterate(ref.loader)
    for _ in range(2):
        x, y = next(it)
        ref.step(x, y)
    ckpt.save(8)
    ckpt.wait()
    rng_at_save = torch.get_rng_state()
    rest = []
    for x, y in it:
        ref.step(x, y)
        rest.append(x.clone())
    epoch2 = epoch_batches(ckpt, ref)
    final = weights(ref)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fresh = make_run(generator=generator)
    torch.manual_seed(999)  # the restarted process's random state differs before load
    resumed = IncrementalCheckpointer(fresh.acc, store)
    assert resumed.load() == 8
    assert fresh.loader.iteration == 1
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    got_rest = epoch_batches(resumed, fresh)
    assert len(got_rest) == len(rest) == 4
    assert all(torch.equal(a, b) for a, b in zip(rest, got_rest, strict=True))
    assert fresh.loader.iteration == 2
    got_epoch2 = epoch_batches(resumed, fresh)
    assert all(torch.equal(a, b) for a, b in zip(epoch2, got_epoch2, strict=True))
    assert same(final, weights(fresh))


def test_resume_after_a_finished_epoch_starts_the_next(tmp_path: Path) -> None:
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "s"))
    epoch_batches(ckpt, run)
    ckpt.save(6)
    ckpt.wait()
    nxt = epoch_batches(ckpt, run)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fresh = make_run()
    resumed = IncrementalCheckpointer(fresh.acc, str(tmp_path / "s"))
    assert resumed.load() == 6
    got = epoch_batches(resumed, fresh)
    assert all(torch.equal(a, b) for a, b in zip(nxt, got, strict=True))


def test_take_over_save_state_and_load_state(tmp_path: Path) -> None:
    run = make_run()
    ckpt = enable(run.acc, str(tmp_path / "s"))
    assert ckpt is not None
    assert run.acc.save_state() == ckpt.store.url
    x, y = next(iter(run.loader))
    run.step(x, y)
    run.acc.save_state("ignored/dir")
    assert ckpt.steps() == [0, 1]
    assert run.acc.project_configuration.iteration == 2
    saved = weights(run)
    run.step(x, y)
    run.acc.project_configuration.iteration = 0
    assert run.acc.load_state() == 1
    assert same(saved, weights(run))
    assert run.acc.project_configuration.iteration == 2  # as after the save, not 0
    with pytest.raises(RuntimeError, match="already taken over"):
        ckpt.take_over()
    ckpt.release()
    assert "save_state" not in vars(run.acc) and "load_state" not in vars(run.acc)


def test_enable_without_flag_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(accelerate_incremental.ENV_DIR, raising=False)
    monkeypatch.delenv(accelerate_incremental.ENV_CONFIG, raising=False)
    run = make_run()
    assert enable(run.acc) is None
    assert "save_state" not in vars(run.acc)


def test_enable_from_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "inc.json"
    config.write_text(json.dumps({"dirpath": str(tmp_path / "s"), "keep_last": 2}))
    monkeypatch.delenv(accelerate_incremental.ENV_DIR, raising=False)
    monkeypatch.setenv(accelerate_incremental.ENV_CONFIG, str(config))
    run = make_run()
    ckpt = enable(run.acc)
    assert ckpt is not None and ckpt.store.config.keep_last == 2
    for _ in range(3):
        run.acc.save_state()
    assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("value", ["", "  ", "1", "true", "OFF"])
def test_bad_flag_values(value: str) -> None:
    with pytest.raises(ConfigError, match="must be the checkpoint directory or URL"):
        settings({accelerate_incremental.ENV_DIR: value})


def test_bad_config_files(tmp_path: Path) -> None:
    env = accelerate_incremental.ENV_CONFIG
    assert settings({}) is None
    with pytest.raises(ConfigError, match="cannot read the config file"):
        settings({env: str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{dirpath: ")
    with pytest.raises(ConfigError, match="not valid JSON"):
        settings({env: str(bad)})
    bad.write_text('{"dirpath": "x", "keep": 2}')
    with pytest.raises(ConfigError, match=r"unknown keys \['keep'\]"):
        settings({env: str(bad)})
    bad.write_text('{"keep_last": 2}')
    with pytest.raises(ConfigError, match="'dirpath'"):
        settings({env: str(bad)})
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        settings({env: str(bad)})
    with pytest.raises(ConfigError, match="not both"):
        settings({env: str(bad), accelerate_incremental.ENV_DIR: "d"})
    good = tmp_path / "good.json"
    good.write_text('{"dirpath": "d", "every_n_steps": 5, "options": {"full_every": 4}}')
    assert settings({env: str(good)}) == {"dirpath": "d", "every_n_steps": 5, "full_every": 4}


def test_bad_store_option_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "inc.json"
    config.write_text(json.dumps({"dirpath": str(tmp_path / "s"), "keep_last": 0}))
    monkeypatch.setenv(accelerate_incremental.ENV_CONFIG, str(config))
    monkeypatch.delenv(accelerate_incremental.ENV_DIR, raising=False)
    run = make_run()
    with pytest.raises(ConfigError, match="keep_last"):
        enable(run.acc)


def test_corrupt_checkpoint_raises(tmp_path: Path) -> None:
    run = make_run()
    save_once(run, str(tmp_path / "s"))
    for pack in (tmp_path / "s" / "packs").rglob("*"):
        if pack.is_file():
            pack.write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError), pytest.warns(UserWarning, match="unusable"):
        IncrementalCheckpointer(run.acc, str(tmp_path / "s")).load()


def _as_saved_by_two_processes(url: str) -> None:
    """The newest checkpoint of ``url`` as two processes would have saved it: both at the same
    position, each epoch's order drawn from the main process's states (as Accelerate's
    synchronized generator makes it)."""
    with CheckpointStore(url) as store:
        state = store.load()
        state["processes"] = state["processes"] * 2
        store.save(state, 2).wait()


def _ids(batch: Any) -> list[int]:
    return [int(v) // 4 for v in batch[0][:, 0]]  # sample i holds 4i, ... (make_run)


def _epoch_saved_after_one_batch_by_two(url: str, *, generator: bool = True) -> list[list[int]]:
    """Train one epoch of :func:`make_run`, saving after its first batch, and present that
    checkpoint as two processes' (see :func:`_as_saved_by_two_processes`); returns the epoch's
    batches (sample ids) in order."""
    run = make_run(generator=generator)
    order = []
    with IncrementalCheckpointer(run.acc, url) as ckpt:
        for batch in ckpt.iterate(run.loader):
            order.append(_ids(batch))
            if len(order) == 1:
                ckpt.save(1)
    _as_saved_by_two_processes(url)
    return order


@pytest.mark.parametrize("generator", [True, False], ids=["seeded-generator", "global-rng"])
def test_a_checkpoint_of_two_processes_resumes_on_one_with_the_rest_of_the_epoch(
    tmp_path: Path, generator: bool
) -> None:
    """Saved after 1 batch per process by 2 processes, the epoch had trained its first 2
    batches; resumed on 1 process it trains exactly the rest of that epoch's order, once."""
    url = str(tmp_path / "s")
    order = _epoch_saved_after_one_batch_by_two(url, generator=generator)
    resumed = make_run(generator=generator)
    with IncrementalCheckpointer(resumed.acc, url) as ckpt:
        with pytest.warns(UserWarning, match="resuming on 1 process.es. a checkpoint saved by 2"):
            assert ckpt.load() == 2
        got = [_ids(batch) for batch in ckpt.iterate(resumed.loader)]
        assert got == order[2:]  # the epoch's order after the first 2 * 1 batches
    flat = sorted(i for batch in order[:2] + got for i in batch)
    assert flat == list(range(12))  # every sample of the epoch exactly once


def test_a_scripts_own_skip_after_a_resized_load_is_told_what_happens(tmp_path: Path) -> None:
    """Under the takeover, a script that resumes by hand (``load_state`` then
    ``skip_first_batches(loader, its own count)``) is told that the epoch goes on with this
    process's share of its rest, and it does."""
    url = str(tmp_path / "s")
    order = _epoch_saved_after_one_batch_by_two(url)
    resumed = make_run()
    with IncrementalCheckpointer(resumed.acc, url) as ckpt:
        ckpt.take_over()
        with pytest.warns(UserWarning, match="a checkpoint saved by 2"):
            resumed.acc.load_state()
        with pytest.warns(UserWarning, match="share of the samples it had left"):
            loader = resumed.acc.skip_first_batches(resumed.loader, 1)
        got = [_ids(batch) for batch in loader]
        ckpt.release()
    assert got == order[2:]


def test_a_resumed_epoch_interrupted_again_goes_on_from_its_rest(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    order = _epoch_saved_after_one_batch_by_two(url)
    once = make_run()
    with IncrementalCheckpointer(once.acc, url) as ckpt, pytest.warns(UserWarning):
        ckpt.load()
        for n, batch in enumerate(ckpt.iterate(once.loader), start=1):
            assert _ids(batch) == order[1 + n]
            if n == 2:
                ckpt.save(3)
                break
        ckpt.wait()
    with CheckpointStore(url) as store:
        saved = store.load(3)["processes"][0]["loaders"][0]
    assert saved["consumed"] == 3 and saved["segment"]["first_batch"] == 1
    twice = make_run()
    with IncrementalCheckpointer(twice.acc, url) as ckpt:
        ckpt.load()  # the same number of processes: the epoch goes on from its recorded rest
        got = [_ids(batch) for batch in ckpt.iterate(twice.loader)]
    assert got == order[4:]


def test_a_dispatching_loader_is_not_cut_anew(tmp_path: Path) -> None:
    """``dispatch_batches=True``: the main process reads each batch and slices it across the
    processes, another layout than whole batches in turn; refused, not cut wrongly."""
    from accelerate import DataLoaderConfiguration
    from accelerate.data_loader import DataLoaderDispatcher

    from accelerate_incremental import _resize

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    data = TensorDataset(torch.arange(48, dtype=torch.float32).reshape(12, 4), torch.randn(12, 1))
    loader = acc.prepare(DataLoader(data, batch_size=2, shuffle=True))
    assert isinstance(loader, DataLoaderDispatcher)
    assert _resize.layout(loader) == (
        "the DataLoader dispatches batches from the main process (dispatch_batches=True)"
    )


def test_an_epoch_that_cannot_be_cut_anew_is_refused_with_the_reason(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    run = make_run()
    with IncrementalCheckpointer(run.acc, url) as ckpt:
        for _ in ckpt.iterate(run.loader):
            ckpt.save(1)
            break
        ckpt.wait()
    _as_saved_by_two_processes(url)
    other = make_run()
    other.loader.batch_sampler.sampler = list(range(12))  # not a sampler whose order is known
    with pytest.raises(ValueError, match=r"cannot be cut for 1: .*sampler is a list"):
        IncrementalCheckpointer(other.acc, url).load()


def test_unchanged_state_costs_almost_nothing(tmp_path: Path) -> None:
    run = make_run(hidden=256)
    with IncrementalCheckpointer(run.acc, str(tmp_path / "s")) as ckpt:
        first = ckpt.save(1)
        assert first is not None
        second = ckpt.save(2)
        assert second is not None
        full, again = first.wait(), second.wait()
    assert full.bytes_logical == again.bytes_logical > 10_000
    assert full.objects_written > 0
    assert again.objects_written == 0  # only a manifest: every chunk is referenced
    assert again.chunks_reused == again.chunks_total


def test_stateful_dataloader_refused(tmp_path: Path) -> None:
    run = make_run()
    run.loader.use_stateful_dataloader = True
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        IncrementalCheckpointer(run.acc, str(tmp_path / "s")).save(1)


def test_single_process_accelerator_in_multi_process_launch_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = Accelerator(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*Accelerator\(cpu=True\)"):
        IncrementalCheckpointer(acc, str(tmp_path / "s"))


def train_epochs(ckpt: IncrementalCheckpointer, run: Run, style: str, *, stop_at: int = -1) -> int:
    """Three epochs with ``maybe_save`` after every batch and work at each epoch's end (an
    epoch-interval scheduler step, random draws), in the loop style of many scripts:
    ``while loader.iteration < 3`` or ``for epoch in range(step // len(loader), 3)``. Returns
    the step reached (stopping early, after the newest save committed, at ``stop_at``)."""
    step = run.counter.value
    epochs = iter(range(step // len(run.loader), 3)) if style == "range" else None
    while (next(epochs, None) is not None) if epochs else run.loader.iteration < 3:
        for x, y in ckpt.iterate(run.loader):
            run.step(x, y)
            step = run.counter.value
            ckpt.maybe_save(step)
            if step == stop_at:
                ckpt.wait()
                return step
        run.sched.step()
        torch.rand(3)
    ckpt.wait()
    return step


@pytest.mark.parametrize("style", ["while", "range"])
def test_checkpoint_at_an_epochs_last_batch_resumes_into_the_next_epoch(
    tmp_path: Path, style: str
) -> None:
    """A save due at an epoch's last batch is taken once the epoch's end work ran (at the next
    iterate), so a run interrupted after it resumes exactly, whatever the loop looks like."""
    ref = make_run()
    with IncrementalCheckpointer(ref.acc, str(tmp_path / "ref"), every_n_steps=6) as ckpt:
        train_epochs(ckpt, ref, style)
        assert ckpt.steps() == [6, 12, 18]
    final = weights(ref)
    for attempt in range(2):  # interrupted at step 8 (after the save of step 6), then resumed
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        run = make_run()
        ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "run"), every_n_steps=6)
        resumed = ckpt.load()
        assert resumed == (None if attempt == 0 else 6)
        train_epochs(ckpt, run, style, stop_at=8 if attempt == 0 else -1)
        ckpt.close()
    assert same(final, weights(run))
