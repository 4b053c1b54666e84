from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# torch's C++ side logs a warning each time a TCPStore client finds its server gone ("recvValue
# failed ... Connection was likely closed"): every test whose processes or process groups end
# makes some, written straight to the terminal past pytest's capture, and none says anything
# wrong. Errors still print. Set before torch is imported (it reads the level once); the
# processes the tests start inherit it.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.storage import register_scheme, registered_schemes
from tests.s3_server import s3_bucket, s3_defaults, s3_endpoint, s3_faults  # noqa: F401

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _signal_handlers_put_back() -> Iterator[None]:
    """A test's preemption installs end with it: an adapter a test never closes (an Accelerator,
    a Trainer) leaves its handlers installed, and later tests of this process would find them —
    their watcher threads, their handlers chained under new installs."""
    from lightning_incremental.runtime.policy import preemption

    before = {signum: signal.getsignal(signum) for signum in _HANDLED}
    yield
    for signum, handler in before.items():
        for _ in range(1000):  # each uninstall puts back the install below it
            current = signal.getsignal(signum)
            owner = preemption._installed(current)
            if current == handler or owner is None:
                break
            owner.uninstall()
        if signal.getsignal(signum) != handler:
            signal.signal(signum, handler)


STORE_BACKENDS = ("local", "memory", "s3")
# LI_TEST_DEPTH=deep: the long randomized tests at their full depth (a soak before a release);
# by default they run at a depth that keeps the suite within CI's time. Hypothesis draws new
# examples on every run, so the default depth still covers more over successive runs.
DEEP = os.environ.get("LI_TEST_DEPTH", "") == "deep"


@pytest.fixture(params=STORE_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh store location on each storage backend of the conformance suite."""
    with backend_url(request.param, request, tmp_path) as url:
        yield url


@contextmanager
def backend_url(kind: str, request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh location on the backend ``kind``: ``local``, ``memory``, ``s3`` or ``plugin``
    (tests/storage_plugin.py, registered by code). The S3 store is in a new bucket of the
    loopback endpoint (tests/s3_server.py), whose options are fsspec's defaults for s3://
    meanwhile, so the bare URL opens it."""
    if kind == "local":
        yield str(tmp_path / "store")
    elif kind == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        with s3_defaults(endpoint.options()):
            yield f"s3://{bucket}/store"
    elif kind == "plugin":
        from tests import storage_plugin

        if storage_plugin.SCHEME not in registered_schemes():
            register_scheme(storage_plugin.SCHEME, storage_plugin.open_dict_storage)
        url = f"{storage_plugin.SCHEME}://li-test-{uuid.uuid4().hex}/store"
        yield url
        storage_plugin.forget(url)
    else:
        url = f"memory://li-test-{uuid.uuid4().hex}"
        yield url
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


@pytest.fixture
def local_url(tmp_path) -> str:
    return str(tmp_path / "store")


def dead_pid() -> int:
    """The id of a process that has exited (reused by another meanwhile: then a live one)."""
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(exited.stdout)


def small_store(url: str, **options) -> CheckpointStore:
    """A store with small chunks and packs so that small test states span many objects. Its
    changed chunks are coded in full unless ``codec_effort`` is given: under ``"auto"`` how a
    chunk is coded depends on how fast the machine codes and writes (``test_pace.py``)."""
    options.setdefault("chunk_size", 4096)
    options.setdefault("codec_effort", "full")
    options.setdefault("pack_size", 16384)
    return CheckpointStore(url, **options)


def walk_store(url: str, steps: int, seed: int = 0, **options) -> tuple[CheckpointStore, dict]:
    """A store of ``steps`` checkpoints of three tensors that each take a small random step from
    the one before: with unbounded chains its newest chunks are chains of ``steps`` links
    (XOR or arithmetic deltas, as the codec chooses). Returns it and the last state."""
    options.setdefault("max_chain_ratio", 100.0)
    options.setdefault("full_every", 100)
    store = small_store(url, **options)
    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(3000, generator=g) for i in range(3)}
    for step in range(1, steps + 1):
        state = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        store.save(state, step).wait()
    return store, state


def assert_state_equal(actual, expected, path: str = "state") -> None:
    """Bit-exact equality of nested states: same types, dtypes, shapes and bytes."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        a = _bytes_of(actual)
        e = _bytes_of(expected)
        if a is not None:
            assert torch.equal(a, e), f"{path}: bytes differ"
        assert actual.requires_grad == expected.requires_grad, f"{path}: requires_grad"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys differ"
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{path}: expected nan"
    else:
        import numpy as np

        if isinstance(expected, np.ndarray):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
            assert actual.tobytes() == expected.tobytes(), f"{path}: bytes differ"
        else:
            assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _bytes_of(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor's element bytes, whatever its strides, conj or neg bits."""
    if not t.numel():
        return None
    src = t.detach().resolve_conj().resolve_neg().cpu()
    dense = torch.empty(src.shape, dtype=src.dtype)
    dense.copy_(src)
    return dense.reshape(-1).view(torch.uint8)


#: Modules whose slow tests run in this process, or start processes that time nothing of their
#: own: the test command runs them on every core beside the quick tests (marked ``spread``),
#: leaving one at a time only to tests whose processes watch each other's timing.
SPREAD_MODULES = frozenset(
    {
        "test_faults.py",
        "test_stateful.py",
        "test_resume_matrix.py",  # one driver forks one run at a time; crashes by os._exit
        "test_pool_stateful.py",
        "test_memory_pruning.py",  # two processes of one node; a kill, no timing
        "test_docs.py",
        "test_benchmarks.py",
        "test_cli.py",
        "test_demo.py",
        "test_scale_benchmark.py",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=("beside", "alone"),
        default=None,
        help="of the selected tests, run only those that may run beside others (the quick ones "
        "and the slow ones marked spread: on every core) or only those that run one at a time "
        "(slow, not spread); scripts/test.sh runs both phases",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fault-injection suite's S3 variants repeat, over HTTP, what the S3 suite already
    covers with faults at the HTTP level: they run in the full suite, not the quick subset.
    Slow tests of :data:`SPREAD_MODULES` are also marked ``spread``. ``--phase`` keeps one
    phase's tests."""
    for item in items:
        if item.nodeid.startswith("tests/engine/test_faults.py") and "[s3" in item.nodeid:
            item.add_marker(pytest.mark.slow)
        if item.path.name in SPREAD_MODULES and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.spread)
    phase = config.getoption("--phase")
    if phase is None:
        return
    kept, dropped = [], []
    for item in items:
        alone = item.get_closest_marker("slow") is not None and (
            item.get_closest_marker("spread") is None
        )
        (kept if alone == (phase == "alone") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
