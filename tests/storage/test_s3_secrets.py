"""Secrets never go in: credentials and the other storage_options values reach the S3 client and
nothing else — no stored object (manifests included), no record of the library's logger, no
error message or traceback, no repr or URL of a store — also when things fail.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from typing import Any

import pytest
import torch

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    StorageError,
)
from tests.s3_server import FaultPlan, S3Endpoint

KEY_ID = "AKIA-TEST-SECRET-KEY-ID"
SECRET = "super-secret-value-123"
TOKEN = "session-token-secret-456"
WAIT_S = 60.0


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(128), "step": step}


def test_secrets_never_go_in(
    s3_endpoint: S3Endpoint,
    s3_bucket: str,
    s3_faults: FaultPlan,
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = s3_endpoint.options(
        faulty=True,
        key=KEY_ID,
        secret=SECRET,
        token=TOKEN,
        config_kwargs={"retries": {"total_max_attempts": 2}, "read_timeout": 5},
    )
    values = [KEY_ID, SECRET, TOKEN, options["endpoint_url"]]
    url = f"s3://{s3_bucket}/store"
    errors: list[BaseException] = []
    texts: list[str] = []
    caplog.set_level(logging.DEBUG, logger="lightning_incremental")

    def fails(kind: type[BaseException], call: Any) -> None:
        with pytest.raises(kind) as raised:
            call()
        errors.append(raised.value)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = CheckpointStore(url, storage_options=options, chunk_size=4096, pack_size=16384)
        texts += [repr(store), store.url, repr(store.storage), str(store.config)]
        # the whole life of a store
        store.save(state(1), 1, metadata={"loss": 0.5}).wait(WAIT_S)
        store.save(state(2), 2).wait(WAIT_S)
        store.load()
        assert store.verify(2).ok
        store.compact()
        store.gc(keep_last=1)
        # transient faults: retried, logged
        s3_faults.error(503, method="PUT", times=1)
        s3_faults.reset(method="GET", times=1)
        store.save(state(3), 3).wait(WAIT_S)
        store.load(3)
        # an injected persistent failure, a refusal
        s3_faults.error(500, method="PUT", key="/packs/", times=None)
        fails(StorageError, lambda: store.save(state(4), 4).wait(WAIT_S))
        s3_faults.clear()
        s3_faults.error(403, method="GET", times=None)
        fails(StorageError, lambda: store.load(3))
        s3_faults.clear()
        store.close()
        # a wrong bucket, an endpoint nobody listens on, bad options
        wrong = CheckpointStore("s3://li-test-no-such-bucket-9/x", storage_options=options)
        fails(StorageError, lambda: wrong.save(state(1), 1).wait(WAIT_S))
        fails(CheckpointNotFoundError, wrong.load)
        wrong.close()
        gone = dict(options, endpoint_url="http://127.0.0.1:9")  # discard port: refused
        values.append(gone["endpoint_url"])

        def unreachable() -> None:  # opening reads the store's pool record: it fails there
            with CheckpointStore(url, storage_options=gone) as store:
                store.save(state(1), 1).wait(WAIT_S)

        fails(StorageError, unreachable)
        bad = dict(options, config_kwargs={"retries": {"total_max_attempts": SECRET}})
        fails(ConfigError, lambda: CheckpointStore(url, storage_options=bad))
    assert len(errors) == 6
    assert any("Retrying" in r.getMessage() or "retrying" in r.getMessage() for r in caplog.records)

    # stored objects, manifests among them
    objects = s3_endpoint.objects(s3_bucket)
    assert any("/manifests/" in key for key in objects)
    for key, data in objects.items():
        for value in values:
            assert value not in key and value.encode() not in data, f"{value!r} in object {key}"
    # log records of the library (every level), with their tracebacks
    records = [r for r in caplog.records if r.name.startswith("lightning_incremental")]
    assert records
    for record in records:
        text = record.getMessage()
        if record.exc_info:
            text += "".join(traceback.format_exception(*record.exc_info))
        texts.append(text)
    # errors: message, repr and the traceback a user sees
    for error in errors:
        texts += [str(error), repr(error), "".join(traceback.format_exception(error))]
    texts += [str(w.message) for w in caught]
    for text in texts:
        for value in values:
            assert value not in text, f"{value!r} leaked: {text}"
    # the redacted messages still say where things went wrong
    assert any("<storage_options.endpoint_url>" in text for text in texts)
    assert f"{url}/packs/" in str(errors[0]) and "HTTP 500" in str(errors[0])
