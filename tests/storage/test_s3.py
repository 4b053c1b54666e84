"""S3: the commit protocol on a real S3 endpoint (moto on loopback) and storage faults injected at
the HTTP level by the proxy of tests/s3_server.py — 500 InternalError, 503 SlowDown, timeouts,
connection resets, lost responses, a multipart upload failing half way.

What must hold whatever fails: a transient fault costs a retry and nothing else; a persistent one
fails that save with a StorageError naming the object and the cause, leaves no manifest and no
open multipart upload behind, and the same store saves again once the fault clears.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError, StepError, StorageError
from lightning_incremental.core.chunks import packs
from lightning_incremental.core.format.layout import manifest_path
from lightning_incremental.core.storage import open_storage
from lightning_incremental.core.storage.retry import RetryPolicy
from lightning_incremental.core.storage.s3 import S3Storage
from tests.conftest import assert_state_equal
from tests.s3_server import FaultPlan, S3Endpoint

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part
FAST = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=0.004)
TIMEOUTS = {"read_timeout": 10.0, "connect_timeout": 10.0}  # no test hangs for long
STALL_TIMEOUTS = {"read_timeout": 0.5, "connect_timeout": 0.5}  # a stalled request: 0.5 s
WAIT_S = 60.0


@pytest.fixture
def url(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/store"


def s3_storage(
    endpoint: S3Endpoint,
    url: str,
    *,
    faulty: bool = True,
    timeouts: dict[str, float] = TIMEOUTS,
    **settings: Any,
) -> S3Storage:
    """Storage through the fault proxy (or straight to moto), retrying fast."""
    settings.setdefault("retry", FAST)
    settings.setdefault("part_size", PART)
    options = endpoint.options(faulty=faulty, config_kwargs=dict(timeouts))
    return S3Storage.from_url(url, options, **settings)


def small_store(storage: S3Storage, **options: Any) -> CheckpointStore:
    return CheckpointStore(storage, chunk_size=4096, pack_size=16384, **options)


@pytest.fixture(autouse=True)
def full_size_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pack at ``pack_size`` (the multipart tests need 11 MiB ones): the packs near the
    end of a save are otherwise made smaller (see ``packs.TAIL_PACK``)."""
    monkeypatch.setattr(packs, "TAIL_PACK", 1 << 40)


def big_store(storage: S3Storage) -> CheckpointStore:
    """Packs of ~11 MiB: each one a multipart upload of three parts (5 + 5 + 1 MiB)."""
    return CheckpointStore(storage, chunk_size=MiB, pack_size=11 * MiB, xor_delta=False)


def state(step: int) -> dict[str, Any]:
    """~40 KiB of tensors (several 16 KiB packs per save) and plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"a": torch.randn(4096, generator=g), "b": torch.randn(32, 64, generator=g)},
        "frozen": torch.arange(2048, dtype=torch.float32),
        "step": step,
    }


def big_state(step: int) -> dict[str, Any]:
    """12 MiB of incompressible bytes."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randint(0, 256, (12 * MiB,), generator=g, dtype=torch.uint8), "step": step}


def committed(endpoint: S3Endpoint, bucket: str) -> list[str]:
    """Manifest keys in the bucket, read behind the store's back."""
    page = endpoint.client.list_objects_v2(Bucket=bucket, Prefix="store/manifests/")
    return sorted(item["Key"][len("store/") :] for item in page.get("Contents", []))


def assert_loads(endpoint: S3Endpoint, url: str, expected: dict[int, dict[str, Any]]) -> None:
    """A fresh store, straight to moto, sees exactly ``expected`` and restores it."""
    with small_store(s3_storage(endpoint, url, faulty=False)) as fresh:
        assert fresh.steps() == sorted(expected)
        for step, saved in expected.items():
            assert_state_equal(fresh.load(step), saved)
            assert fresh.verify(step).ok


# ---------------------------------------------------------------------------- opening


def test_open_storage_gives_s3_storage(s3_endpoint: S3Endpoint, url: str) -> None:
    options = s3_endpoint.options(config_kwargs={"retries": {"max_attempts": 6}})
    before = copy.deepcopy(options)
    storage = open_storage(url, options)
    assert isinstance(storage, S3Storage)
    assert storage.url == url and repr(storage) == f"S3Storage({url!r})"
    assert storage.retry.attempts == 7, "botocore's max_attempts counts retries, not tries"
    assert options == before, "the caller's storage_options were changed"
    assert open_storage(url.replace("s3://", "s3a://"), options).url.startswith("s3a://")


@pytest.mark.parametrize(
    ("url", "settings", "match"),
    [
        ("s3://", {}, "names a bucket"),
        ("s3://bucket/x", {"part_size": MiB}, "part_size"),
        ("s3://bucket/x", {"retry": 3}, "RetryPolicy"),
        ("s3://bucket/x", {"max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_settings(
    s3_endpoint: S3Endpoint, url: str, settings: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        S3Storage.from_url(url, s3_endpoint.options(), **settings)


def test_retry_policy() -> None:
    policy = RetryPolicy(attempts=4, backoff_s=0.5, max_backoff_s=3.0, jitter=False)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    jittered = RetryPolicy(backoff_s=1.0, max_backoff_s=100.0)
    for failures in range(1, 8):
        base = 2.0 ** (failures - 1)
        assert base / 2 <= jittered.delay(failures) <= base
    assert RetryPolicy().delay(10_000) == pytest.approx(RetryPolicy().max_backoff_s, rel=0.5)
    for bad in ({"attempts": 0}, {"attempts": True}, {"backoff_s": -1}, {"jitter": 1}):
        with pytest.raises(ConfigError):
            RetryPolicy(**bad)


# ---------------------------------------------------------------------------- writes


def test_large_objects_use_multipart_upload(
    s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    storage = s3_storage(s3_endpoint, url, faulty=False)
    data = torch.randint(0, 256, (2 * PART + 7,), dtype=torch.uint8).numpy().tobytes()
    assert storage.put("packs/big", data) is True
    etag = s3_endpoint.client.head_object(Bucket=s3_bucket, Key="store/packs/big")["ETag"]
    assert etag.strip('"').endswith("-3"), f"not a 3-part upload: {etag}"
    assert storage.get("packs/big") == data
    assert storage.get("packs/big", PART - 3, PART + 3) == data[PART - 3 : PART + 3]
    assert storage.put("packs/big", data) is False  # create-only
    assert storage.list_multipart_uploads() == []
    assert s3_endpoint.open_uploads(s3_bucket) == []


def test_a_checkpoint_of_multipart_packs_round_trips(
    s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    saved = big_state(1)
    with big_store(s3_storage(s3_endpoint, url, faulty=False)) as store:
        store.save(saved, 1).wait(WAIT_S)
        assert_state_equal(store.load(), saved)
        assert store.verify(1).ok
    etags = [
        item["ETag"]
        for item in s3_endpoint.client.list_objects_v2(Bucket=s3_bucket)["Contents"]
        if "/packs/" in item["Key"]
    ]
    assert any(e.strip('"').endswith("-3") for e in etags), etags
    assert s3_endpoint.open_uploads(s3_bucket) == []


def test_create_only_writes_are_conditional(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, url: str
) -> None:
    storage = s3_storage(s3_endpoint, url)
    assert storage.put("manifests/x.json", b"first") is True
    assert storage.put("manifests/x.json", b"second", overwrite=True) is True
    puts = s3_faults.seen("PUT", "/manifests/x.json")
    assert [p.headers.get("if-none-match") for p in puts] == ["*", None]


def test_a_name_taken_after_the_check_is_not_overwritten(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    """Another writer creates the object between our HEAD and our PUT (the HEAD is made to
    answer 404): If-None-Match refuses our write. Without conditional writes that race is lost
    — documented, and harmless for content-addressed data objects."""
    key = "store/manifests/x.json"
    s3_endpoint.client.put_object(Bucket=s3_bucket, Key=key, Body=b"theirs")
    s3_faults.error(404, method="HEAD", key="/manifests/x.json", times=None)
    assert s3_storage(s3_endpoint, url).put("manifests/x.json", b"ours") is False
    assert s3_endpoint.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == b"theirs"
    plain = s3_storage(s3_endpoint, url, conditional_writes=False)
    assert plain.put("manifests/x.json", b"ours") is True
    assert s3_endpoint.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == b"ours"


@pytest.mark.parametrize("same", [True, False], ids=["same-bytes", "other-bytes"])
def test_a_name_taken_during_a_multipart_upload(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str, same: bool
) -> None:
    """Completing the upload is refused (If-None-Match); the upload is aborted either way, and
    the write counts as done when the object holds the same bytes (content-addressed data)."""
    data = torch.randint(0, 256, (PART + 7,), dtype=torch.uint8).numpy().tobytes()
    theirs = data if same else data[::-1]
    s3_endpoint.client.put_object(Bucket=s3_bucket, Key="store/packs/big", Body=theirs)
    s3_faults.error(404, method="HEAD", key="/packs/big", times=None)
    assert s3_storage(s3_endpoint, url).put("packs/big", data) is same
    stored = s3_endpoint.client.get_object(Bucket=s3_bucket, Key="store/packs/big")["Body"]
    assert stored.read() == theirs
    assert s3_endpoint.open_uploads(s3_bucket) == []


def test_of_two_committers_of_one_step_one_wins(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    with (
        small_store(s3_storage(s3_endpoint, url)) as a,
        small_store(s3_storage(s3_endpoint, url)) as b,
    ):
        a.save(state(0), 0).wait(WAIT_S)
        assert_state_equal(b.load(), state(0))  # b knows step 0 and builds on it
        a.save(state(1), 1).wait(WAIT_S)
        # b does not see a's step 1 when it checks: only If-None-Match stops it
        s3_faults.error(404, method="HEAD", key="/manifests/", times=None)
        with pytest.raises(StepError, match="already committed"):
            b.save(state(100), 1).wait(WAIT_S)
    assert committed(s3_endpoint, s3_bucket) == [manifest_path(0), manifest_path(1)]
    assert_loads(s3_endpoint, url, {0: state(0), 1: state(1)})


def test_conditional_writes_fall_back_when_not_implemented(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    s3_faults.error(501, method="PUT", header="If-None-Match", times=None)
    storage = s3_storage(s3_endpoint, url)
    with caplog.at_level(logging.WARNING, logger="lightning_incremental"):
        assert storage.put("packs/a", b"1") is True
    assert "does not support conditional writes" in caplog.text
    assert storage.conditional_writes is False
    assert storage.put("packs/b", b"2") is True
    assert storage.put("packs/b", b"3") is False  # still create-only, by the check
    assert storage.get("packs/b") == b"2"


@pytest.mark.parametrize("target", ["/packs/", "/manifests/"])
def test_a_lost_answer_to_a_write_is_recognised(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, url: str, target: str
) -> None:
    """The write lands, the answer is lost, the retry finds the name taken: by our own bytes,
    so the write succeeded (a manifest would otherwise look like another committer's)."""
    with small_store(s3_storage(s3_endpoint, url)) as store:
        rule = s3_faults.drop(method="PUT", key=target)
        assert store.save(state(1), 1).wait(WAIT_S).step == 1
        assert rule.fired == 1
    assert_loads(s3_endpoint, url, {1: state(1)})


def test_a_lost_answer_to_completing_a_multipart_upload(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    rule = s3_faults.drop(method="POST", key="/packs/", query={"uploadId": None})
    with big_store(s3_storage(s3_endpoint, url)) as store:
        store.save(big_state(1), 1).wait(WAIT_S)
        assert_state_equal(store.load(1), big_state(1))
    assert rule.fired == 1
    assert s3_endpoint.open_uploads(s3_bucket) == []


# ---------------------------------------------------------------------------- transient faults

TRANSIENT = {  # fault -> (action, arguments, failures in a row, requests hit)
    "500": ("error", {"status": 500}, 2, ("PUT /packs/", "PUT /manifests/", "HEAD", "GET")),
    "503-slow-down": ("error", {"status": 503}, 2, ("PUT /packs/", "PUT /manifests/", "GET")),
    "connection-reset": ("reset", {}, 2, ("PUT /packs/", "PUT /manifests/", "HEAD", "GET")),
    "timeout": ("stall", {}, 1, ("PUT /packs/", "PUT /manifests/")),  # each costs 0.5 s
}


@pytest.mark.parametrize("fault", list(TRANSIENT))
def test_transient_faults_are_retried(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str, fault: str
) -> None:
    action, args, times, targets = TRANSIENT[fault]
    timeouts = STALL_TIMEOUTS if action == "stall" else TIMEOUTS
    with small_store(s3_storage(s3_endpoint, url, timeouts=timeouts)) as store:
        store.save(state(1), 1).wait(WAIT_S)
        rules = []
        for target in targets:
            method, _, key = target.partition(" ")
            rules.append(s3_faults.add(action, method=method, key=key or None, times=times, **args))
        assert store.save(state(2), 2).wait(WAIT_S).step == 2
        assert_state_equal(store.load(2), state(2))
        assert store.verify(1).ok
    assert [rule.fired for rule in rules] == [times] * len(rules), "a fault did not fire"
    assert committed(s3_endpoint, s3_bucket) == [manifest_path(1), manifest_path(2)]


# ---------------------------------------------------------------------------- persistent faults

PERSISTENT = {
    "500": ("error", {"status": 500}, "HTTP 500 InternalError"),
    "503-slow-down": ("error", {"status": 503}, "HTTP 503 SlowDown"),
    "connection-reset": ("reset", {}, "Error: "),
}


@pytest.mark.parametrize(
    ("fault", "target"),
    [
        ("500", "packs"),
        ("503-slow-down", "packs"),
        ("connection-reset", "packs"),
        ("500", "manifests"),
    ],
)
def test_a_persistent_fault_fails_the_save_and_commits_nothing(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str, fault: str, target: str
) -> None:
    action, args, cause = PERSISTENT[fault]
    with small_store(s3_storage(s3_endpoint, url)) as store:
        store.save(state(1), 1).wait(WAIT_S)
        s3_faults.add(action, method="PUT", key=f"/{target}/", times=None, **args)
        with pytest.raises(StorageError) as raised:
            store.save(state(2), 2).wait(WAIT_S)
        message = str(raised.value)
        assert f"writing {url}/{target}/" in message, "the error does not name the object"
        assert cause in message and f"after {FAST.attempts} attempts" in message
        failed_key = message.split(f"{url}/", 1)[1].split(" ", 1)[0]
        sent = len(s3_faults.seen("PUT", failed_key, action=action))
        if action == "reset":  # aiohttp resends an idempotent request once when a reused
            # connection turns out closed (RFC 9112, 9.3.1): still bounded
            assert FAST.attempts <= sent <= 2 * FAST.attempts
        else:
            assert sent == FAST.attempts, "retries are not bounded by the policy"
        assert committed(s3_endpoint, s3_bucket) == [manifest_path(1)]
        assert s3_endpoint.open_uploads(s3_bucket) == []

        s3_faults.clear()  # the store is usable again
        assert store.save(state(3), 3).wait(WAIT_S).step == 3
        store.gc()  # what the failed save left behind goes
    assert_loads(s3_endpoint, url, {1: state(1), 3: state(3)})


def test_retries_are_bounded_and_not_multiplied(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, url: str
) -> None:
    """The attempts asked of botocore are this store's; botocore itself does not retry on top."""
    options = s3_endpoint.options(faulty=True, config_kwargs={"retries": {"total_max_attempts": 2}})
    storage = S3Storage.from_url(url, options)
    assert storage.retry.attempts == 2
    s3_faults.error(503, method="PUT", times=None)
    with pytest.raises(StorageError, match="after 2 attempts"):
        storage.put("packs/x", b"x")
    assert len(s3_faults.seen("PUT", "/packs/x")) == 2


def test_errors_that_retrying_cannot_fix_are_not_retried(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, url: str
) -> None:
    s3_faults.error(403, method="PUT", times=None)
    with pytest.raises(StorageError, match=r"refused .*AccessDenied.*credentials") as raised:
        s3_storage(s3_endpoint, url).put("packs/x", b"x")
    assert raised.value.errno == 13
    assert len(s3_faults.seen("PUT", "/packs/x")) == 1


def test_a_missing_bucket_is_named(s3_endpoint: S3Endpoint) -> None:
    storage = s3_storage(s3_endpoint, "s3://li-test-no-such-bucket/x", faulty=False)
    assert storage.list("") == [] and not storage.exists("")
    with pytest.raises(StorageError, match="bucket 'li-test-no-such-bucket' does not exist"):
        storage.put("store.json", b"{}")
    with pytest.raises(FileNotFoundError):
        storage.get("store.json")


# ---------------------------------------------------------------------------- multipart faults


def test_a_multipart_upload_failing_half_way_is_aborted(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    with big_store(s3_storage(s3_endpoint, url)) as store:
        s3_faults.error(500, method="PUT", key="/packs/", query={"partNumber": "2"}, times=None)
        with pytest.raises(StorageError, match=rf"writing {url}/packs/.*HTTP 500"):
            store.save(big_state(1), 1).wait(WAIT_S)
        assert s3_faults.seen("PUT", "/packs/", action="forward"), "no part was uploaded"
        assert s3_faults.seen("DELETE", "/packs/", action="forward"), "the upload was not aborted"
        assert s3_endpoint.open_uploads(s3_bucket) == []
        assert committed(s3_endpoint, s3_bucket) == []

        s3_faults.clear()
        store.save(big_state(2), 2).wait(WAIT_S)
        assert_state_equal(store.load(), big_state(2))
    assert s3_endpoint.open_uploads(s3_bucket) == []


def test_a_part_failing_once_is_retried(
    s3_faults: FaultPlan, s3_endpoint: S3Endpoint, s3_bucket: str, url: str
) -> None:
    rule = s3_faults.reset(method="PUT", key="/packs/", query={"partNumber": "2"})
    with big_store(s3_storage(s3_endpoint, url)) as store:
        store.save(big_state(1), 1).wait(WAIT_S)
        assert_state_equal(store.load(), big_state(1))
    assert rule.fired == 1
    assert s3_endpoint.open_uploads(s3_bucket) == []


def test_an_upload_whose_abort_failed_is_aborted_before_the_next_write(
    s3_faults: FaultPlan,
    s3_endpoint: S3Endpoint,
    s3_bucket: str,
    url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with big_store(s3_storage(s3_endpoint, url)) as store:
        s3_faults.error(500, method="PUT", key="/packs/", query={"partNumber": "2"}, times=None)
        s3_faults.error(503, method="DELETE", query={"uploadId": None}, times=None)
        with caplog.at_level(logging.WARNING, logger="lightning_incremental"):
            with pytest.raises(StorageError):
                store.save(big_state(1), 1).wait(WAIT_S)
        assert "could not abort multipart upload" in caplog.text
        assert len(s3_endpoint.open_uploads(s3_bucket)) == 1

        s3_faults.clear()
        store.save(state(2), 2).wait(WAIT_S)
    assert s3_endpoint.open_uploads(s3_bucket) == []
    assert_loads(s3_endpoint, url, {2: state(2)})
