"""Talking to S3: what a failed request means, the retry loop, and the client's options.

Separate from :mod:`lightning_incremental.core.storage.s3` (what is written where, and when) so that
the failure policy can be read in one place: which errors are transient, how often and how
patiently they are retried, and how botocore's own retries are kept from multiplying ours.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
import botocore.exceptions
import botocore.parsers
import fsspec.config

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.core.storage.redaction import redact, secret_strings
from lightning_incremental.core.storage.retry import RetryPolicy

_T = TypeVar("_T")

S3_PROTOCOLS = ("s3", "s3a")

# Error codes that mean "try again later" whatever the status says.
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "TooManyRequestsException",
        "ConditionalRequestConflict",  # a concurrent conditional write of the same key: retry
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"})
_EXISTS_CODES = frozenset({"PreconditionFailed", "412"})
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,  # connection closed or reset, read timeout
    botocore.exceptions.ConnectionError,  # endpoint unreachable, connect timeout
    botocore.exceptions.IncompleteReadError,
    botocore.parsers.ResponseParserError,  # a throttling proxy's garbled answer
    aiohttp.ClientError,
    ConnectionError,
    TimeoutError,
)


class RequestFailed(Exception):
    """A request that failed for good (internal: turned into the caller's error)."""

    def __init__(self, method: str, kind: str, detail: str, attempts: int) -> None:
        super().__init__(detail)
        self.method, self.kind, self.detail, self.attempts = method, kind, detail, attempts


def classify(exc: BaseException) -> str:
    """``missing``, ``exists`` (a failed If-None-Match), ``denied``, ``unsupported``,
    ``transient`` or ``failed``."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _TRANSIENT_CODES or (status >= 500 and status != 501) or status in (408, 429):
            return "transient"
        if code in _MISSING_CODES or status == 404:
            return "missing"
        if code in _EXISTS_CODES or status == 412:
            return "exists"
        if status in (401, 403):
            return "denied"
        if code == "NotImplemented" or status == 501:
            return "unsupported"
        return "failed"
    if isinstance(exc, _TRANSIENT_TYPES):
        return "transient"
    return "failed"


def describe(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = error.get("Code") or "error"
        message = error.get("Message") or ""
        return f"HTTP {status} {code}" + (f": {message}" if message else "")
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def retrying(
    method: str,
    attempt: Callable[[], Awaitable[_T]],
    policy: RetryPolicy,
    on_retry: Callable[[int, float, str], None],
) -> _T:
    """Await ``attempt()`` until it succeeds, fails for good, or ``policy.attempts`` tries
    failed transiently; ``on_retry(attempts, delay, detail)`` is told before each pause.

    Raises:
        RequestFailed: the last failure, classified and described (not chained: the
            backend's exception text may hold an option's value).
    """
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt()
        except Exception as exc:
            kind = classify(exc)
            detail = describe(exc)
            if kind != "transient" or attempts >= policy.attempts:
                raise RequestFailed(method, kind, detail, attempts) from None
        delay = policy.delay(attempts)
        on_retry(attempts, delay, detail)
        await asyncio.sleep(delay)


def client_options(
    protocol: str, storage_options: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str], RetryPolicy | None]:
    """The options to open s3fs with, the secrets to keep out of messages, and the retry
    policy the options ask for (None: the default). fsspec's configured defaults for the
    protocol (``fsspec.config.conf``) are applied first, as s3fs would; the caller's dict is
    not changed; botocore's retries are turned off (S3Storage retries)."""
    options = _defaults(protocol)
    options.update(copy.deepcopy(dict(storage_options)))
    secrets = secret_strings(options)
    attempts = _take_retries(options, secrets)
    return options, secrets, None if attempts is None else RetryPolicy(attempts=attempts)


def _defaults(protocol: str) -> dict[str, Any]:
    """fsspec's configured defaults for the protocol (``fsspec.config.conf``), as s3fs would
    apply them: explicit options win."""
    merged: dict[str, Any] = {}
    for name in S3_PROTOCOLS if protocol in S3_PROTOCOLS else (protocol,):
        merged.update(copy.deepcopy(fsspec.config.conf.get(name, {})))
    return merged


def _take_retries(options: dict[str, Any], secrets: Mapping[str, str]) -> int | None:
    """Turn off botocore's retries in ``options``; return the attempts they asked for."""
    config = options.get("config_kwargs") or {}
    if not isinstance(config, dict):
        raise ConfigError("storage_options['config_kwargs'] must be a dict of botocore settings")
    config = dict(config)
    asked = config.get("retries") or {}
    if not isinstance(asked, dict):
        raise ConfigError("storage_options['config_kwargs']['retries'] must be a dict")
    attempts: int | None = None
    try:
        if asked.get("total_max_attempts") is not None:
            attempts = int(asked["total_max_attempts"])
        elif asked.get("max_attempts") is not None:
            attempts = int(asked["max_attempts"]) + 1
    except (TypeError, ValueError):
        raise ConfigError(
            "storage_options['config_kwargs']['retries'] attempts must be ints, got "
            + redact(repr(asked), secrets)
        ) from None
    config["retries"] = {"total_max_attempts": 1}
    options["config_kwargs"] = config
    return attempts
