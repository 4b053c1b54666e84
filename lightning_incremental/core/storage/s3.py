"""S3Storage: checkpoints on Amazon S3 and S3-compatible object stores, through s3fs.

S3 has no rename, so nothing is ever written under a temporary name and moved into place:

- every object is written once, under its final name, by a single PUT (S3 makes an object
  visible whole or not at all) or, from ``multipart_threshold`` bytes on, by a multipart upload
  (visible only once completed). A multipart upload that fails is aborted, so no parts are left
  behind (and billed); an abort that itself fails is retried before the next write.
- create-only writes (data objects, manifests) first ask whether the object exists (HEAD), then
  PUT with ``If-None-Match: *``: the store refuses the write if the name was taken in between,
  so of two committers of one step exactly one succeeds. On an endpoint without conditional
  writes (``conditional_writes=False``, or one that answers 501) it is exists-then-put; the race
  that leaves is harmless for data objects, which are content-addressed (both writers write the
  same bytes), and manifests are per step and written by one committer (rank 0 of the newest
  generation).
- S3 reads are strongly consistent after a write, so once the manifest's PUT returned every
  reader lists it, and every object it names was durable before it was written.

Transient failures (HTTP 5xx, 503 SlowDown and other throttling, timeouts, reset connections)
are retried by this class with bounded exponential backoff (:class:`RetryPolicy`); botocore's
own retries are turned off so the two do not multiply, and because only this class can tell a
write that was refused from one whose response was lost: when a retried create-only write finds
its name taken, the stored bytes are compared with its own.

Nothing of ``storage_options`` leaves this module: error messages and log records are redacted
(``<storage_options.secret>``), and the backend's exceptions are not shown in tracebacks.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import fsspec.asyn
from s3fs import S3FileSystem

from lightning_incremental.core.errors import ConfigError, StorageError
from lightning_incremental.core.storage.base import Storage
from lightning_incremental.core.storage.filesystem import filesystem
from lightning_incremental.core.storage.redaction import redact
from lightning_incremental.core.storage.retry import RetryPolicy
from lightning_incremental.core.storage.s3_client import (
    S3_PROTOCOLS,
    RequestFailed,
    client_options,
    retrying,
)

log = logging.getLogger("lightning_incremental")

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's smallest part (every part but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
DEFAULT_PART_SIZE = 8 * MiB

_T = TypeVar("_T")


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix``, written create-only and atomically without rename.

    Args:
        fs: an ``s3fs.S3FileSystem`` (its client, credentials and settings are used as they
            are; build one with :meth:`from_url` to have retries handled here).
        root: ``bucket/prefix`` of the store.
        url: the store's URL, as shown in messages.
        retry: how transient failures are retried. Default :class:`RetryPolicy()`.
        part_size: bytes per part of a multipart upload (>= 5 MiB). Default 8 MiB.
        multipart_threshold: objects of at least this many bytes are uploaded in parts.
            Default ``part_size``.
        conditional_writes: send ``If-None-Match: *`` on create-only writes. Default True.
        max_concurrency: parts of one object uploaded at once. Default 4.
        secrets: values to keep out of messages (see ``redaction.secret_strings``).

    Raises:
        ConfigError: a URL without a bucket, or a bad size or count.
    """

    def __init__(
        self,
        fs: S3FileSystem,
        root: str,
        *,
        url: str,
        retry: RetryPolicy | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        multipart_threshold: int | None = None,
        conditional_writes: bool = True,
        max_concurrency: int = 4,
        secrets: Mapping[str, str] | None = None,
    ) -> None:
        bucket, _, prefix = root.strip("/").partition("/")
        if not bucket:
            raise ConfigError(f"an S3 store URL names a bucket (s3://bucket/path), got {url!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        threshold = part_size if multipart_threshold is None else multipart_threshold
        for name, value, minimum in (
            ("part_size", part_size, MIN_PART_SIZE),
            ("multipart_threshold", threshold, 1),
            ("max_concurrency", max_concurrency, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(conditional_writes, bool):
            raise ConfigError(
                f"conditional_writes must be True or False, got {conditional_writes!r}"
            )
        self.fs = fs
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.part_size = part_size
        self.multipart_threshold = threshold
        self.conditional_writes = conditional_writes
        self.max_concurrency = max_concurrency
        self._secrets = dict(secrets or {})
        self._orphans: dict[str, tuple[str, str]] = {}  # upload id -> (path, key), not aborted
        self._lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> S3Storage:
        """The storage at ``s3://bucket/prefix`` with ``storage_options`` for s3fs (endpoint,
        credentials, client and botocore settings; ``fsspec.config.conf["s3"]`` supplies
        defaults). ``config_kwargs={"retries": {"total_max_attempts": N}}`` (or botocore's
        ``max_attempts``) sets the attempts of the retry policy; ``settings`` are the other
        keyword arguments of the constructor.

        Raises:
            ConfigError: bad URL, options or settings.
        """
        protocol = url.split("://", 1)[0].lower() if "://" in url else ""
        if protocol not in S3_PROTOCOLS:
            raise ConfigError(f"not an S3 URL: {url!r} (expected s3://bucket/path)")
        options, secrets, retry = client_options(protocol, storage_options or {})
        if retry is not None and "retry" not in settings:
            settings["retry"] = retry
        fs, root = filesystem(url, protocol, options)
        if not isinstance(fs, S3FileSystem):
            raise ConfigError(f"{protocol}:// did not open an s3fs filesystem: {type(fs).__name__}")
        return cls(fs, root, url=f"{protocol}://{root.strip('/')}", secrets=secrets, **settings)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # ------------------------------------------------------------------ Storage

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        return self._run("writing", path, self._put(path, data, overwrite))

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._run("reading", path, self._get(path, start, end))

    def exists(self, path: str) -> bool:
        return self._run("checking", path, self._exists(path))

    def list(self, prefix: str) -> builtins.list[str]:
        return self._run("listing", prefix, self._list(prefix))

    def listdir(self, prefix: str) -> builtins.list[str]:
        return self._run("listing", prefix, self._list(prefix, one_level=True))

    def delete(self, path: str) -> None:
        self._run("deleting", path, self._delete(path))

    def size(self, path: str) -> int:
        return int(self._run("reading the size of", path, self._head(path))["ContentLength"])

    def mtime(self, path: str) -> float | None:
        modified = self._run("reading the time of", path, self._head(path)).get("LastModified")
        return None if modified is None else float(modified.timestamp())

    def list_multipart_uploads(self) -> builtins.list[tuple[str, str]]:
        """``(path, upload id)`` of every unfinished multipart upload under the store."""
        return self._run("listing the multipart uploads of", "", self._list_uploads())

    # ------------------------------------------------------------------ internals

    def _key(self, path: str) -> str:
        path = path.strip("/")
        if not self.prefix:
            return path
        return f"{self.prefix}/{path}" if path else self.prefix

    def _name(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    def _run(self, what: str, path: str, coro: Awaitable[_T]) -> _T:
        """Run ``coro`` on s3fs's event loop; a failure becomes the caller's error (redacted,
        naming the object and the cause), without the backend's exception attached."""

        async def run() -> _T:
            return await coro

        try:
            return fsspec.asyn.sync(self.fs.loop, run)
        except RequestFailed as failed:
            error = self._error(what, path, failed)
        raise error from None

    def _error(self, what: str, path: str, failed: RequestFailed) -> OSError:
        name, detail = self._name(path), redact(failed.detail, self._secrets)
        if failed.kind == "missing":
            if what == "writing":
                return StorageError(
                    errno.ENOENT,
                    f"cannot write {name}: the bucket {self.bucket!r} does not exist ({detail}); "
                    "create it or correct the URL",
                )
            return FileNotFoundError(errno.ENOENT, f"{what} {name}: {detail}")
        if failed.kind == "denied":
            return StorageError(
                errno.EACCES,
                f"{what} {name} was refused ({detail}); check the credentials in "
                "storage_options and the bucket's policy",
            )
        if failed.kind == "transient":
            return StorageError(
                errno.EIO,
                f"{what} {name} failed after {failed.attempts} attempts, every one with a "
                f"transient error; the last: {detail}",
            )
        return StorageError(errno.EIO, f"{what} {name} failed ({failed.method}): {detail}")

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        """One S3 request, retried on transient failures; raises RequestFailed."""
        return await self._retrying(method, path, lambda: self._client(method, **kw))

    async def _client(self, method: str, **kw: Any) -> Any:
        await self.fs.set_session()
        client = await self.fs.get_s3(self.bucket)
        bound = getattr(client, method)
        return await bound(**self.fs._get_s3_method_kwargs(bound, Bucket=self.bucket, **kw))

    async def _retrying(self, method: str, path: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        def on_retry(attempts: int, delay: float, detail: str) -> None:
            log.debug(
                "S3 %s of %s failed (attempt %d of %d), retrying in %.3fs: %s",
                method,
                self._name(path),
                attempts,
                self.retry.attempts,
                delay,
                redact(detail, self._secrets),
            )

        return await retrying(method, attempt, self.retry, on_retry)

    async def _head(self, path: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("head_object", path, Key=self._key(path))
        return result

    async def _exists(self, path: str) -> bool:
        if not path.strip("/"):  # the store itself: any object under its prefix
            prefix = f"{self.prefix}/" if self.prefix else ""
            try:
                page = await self._call("list_objects_v2", path, Prefix=prefix, MaxKeys=1)
            except RequestFailed as failed:
                if failed.kind == "missing":
                    return False
                raise
            return bool(page.get("KeyCount") or page.get("Contents"))
        try:
            await self._head(path)
        except RequestFailed as failed:
            if failed.kind == "missing":
                return False
            raise
        return True

    async def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        start = start or 0
        if end is not None and end <= start:
            await self._head(path)  # raises when missing
            return b""
        kw: dict[str, Any] = {"Key": self._key(path)}
        if start or end is not None:
            kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        async def attempt() -> bytes:
            response = await self._client("get_object", **kw)
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        try:
            return await self._retrying("get_object", path, attempt)
        except RequestFailed as failed:
            if failed.kind == "failed" and "InvalidRange" in failed.detail:
                return b""  # the range starts past the end: a short read, as on a file
            raise

    async def _list(self, prefix: str, *, one_level: bool = False) -> builtins.list[str]:
        """Every object under ``prefix``; with ``one_level``, only those directly in it (the
        "subdirectories" come back as common prefixes and are left out)."""
        base = self._key(prefix).rstrip("/")
        kw: dict[str, Any] = {"Prefix": f"{base}/" if base else ""}
        if one_level:
            kw["Delimiter"] = "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: builtins.list[str] = []
        while True:
            try:
                page = await self._call("list_objects_v2", prefix, **kw)
            except RequestFailed as failed:
                if failed.kind == "missing":  # no bucket: nothing under it
                    return []
                raise
            for item in page.get("Contents", []):
                key = item["Key"]
                if not key.endswith("/"):  # "directory" markers of other tools
                    out.append(key[strip:])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(out)
            kw["ContinuationToken"] = token

    async def _delete(self, path: str) -> None:
        try:
            await self._call("delete_object", path, Key=self._key(path))
        except RequestFailed as failed:
            if failed.kind != "missing":
                raise

    async def _put(self, path: str, data: bytes | memoryview, overwrite: bool) -> bool:
        if self._orphans:
            await self._abort_orphans()
        key = self._key(path)
        if not overwrite and await self._exists(path):
            return False
        if len(data) and len(data) >= self.multipart_threshold:
            return await self._put_multipart(path, key, memoryview(data), overwrite)
        body = bytes(data)
        try:
            await self._call("put_object", path, Key=key, Body=body, **self._if(overwrite))
        except RequestFailed as failed:
            if failed.kind == "exists":
                return await self._landed(path, body)
            if failed.kind == "unsupported" and self._if(overwrite):
                self._no_conditional_writes(failed)
                return await self._put(path, data, overwrite)
            raise
        return True

    def _if(self, overwrite: bool) -> dict[str, str]:
        """The condition of a write: create-only unless ``overwrite``."""
        return {} if overwrite or not self.conditional_writes else {"IfNoneMatch": "*"}

    def _no_conditional_writes(self, failed: RequestFailed) -> None:
        log.warning(
            "%s does not support conditional writes (%s); create-only writes fall back to "
            "exists-then-put",
            self.url,
            redact(failed.detail, self._secrets),
        )
        self.conditional_writes = False

    async def _landed(self, path: str, data: bytes | memoryview) -> bool:
        """A create-only write found its name taken. True when the object holds our bytes: an
        earlier attempt of this write landed and its answer was lost (a retry, ours or the HTTP
        client's, then finds it), or another writer stored the same bytes (content-addressed
        data objects; a manifest carries its writer's time, host and pid, so never another's).
        False when it holds other bytes."""
        try:
            stored = await self._get(path, None, None)
        except RequestFailed as failed:
            if failed.kind == "missing":
                return False
            raise
        return stored == data

    async def _put_multipart(self, path: str, key: str, data: memoryview, overwrite: bool) -> bool:
        part_size = max(self.part_size, math.ceil(len(data) / MAX_PARTS))
        created = await self._call("create_multipart_upload", path, Key=key)
        upload = created["UploadId"]
        done = False
        try:
            parts = await self._upload_parts(path, key, upload, data, part_size)
            landed = await self._complete(path, key, upload, parts, data, overwrite)
            done = True
            return landed
        finally:
            if not done:
                await self._abort(path, key, upload)

    async def _complete(
        self,
        path: str,
        key: str,
        upload: str,
        parts: builtins.list[dict[str, Any]],
        data: memoryview,
        overwrite: bool,
    ) -> bool:
        """Complete the upload (create-only unless ``overwrite``). When the name is taken the
        upload is aborted, and the result says whether the object holds our bytes."""
        try:
            await self._call(
                "complete_multipart_upload",
                path,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                **self._if(overwrite),
            )
        except RequestFailed as failed:
            if failed.kind == "exists":  # taken, maybe by our attempt whose answer was lost
                await self._abort(path, key, upload)  # gone then, or another writer's bytes
                return await self._landed(path, data)
            if failed.kind == "missing" and await self._landed(path, data):
                return True  # no such upload any more: an attempt of ours completed it
            if failed.kind == "unsupported" and self._if(overwrite):
                self._no_conditional_writes(failed)
                return await self._complete(path, key, upload, parts, data, overwrite)
            raise
        return True

    async def _upload_parts(
        self, path: str, key: str, upload: str, data: memoryview, part_size: int
    ) -> builtins.list[dict[str, Any]]:
        """Upload every part, ``max_concurrency`` at a time. After a part failed no other one
        starts, and the ones in flight are waited for: an abort that raced with a part upload
        could leave that part behind (S3 documents this)."""
        limit = asyncio.Semaphore(self.max_concurrency)
        failed = False

        async def part(number: int, offset: int) -> dict[str, Any] | None:
            nonlocal failed
            async with limit:
                if failed:
                    return None
                body = bytes(data[offset : offset + part_size])
                try:
                    out = await self._call(
                        "upload_part", path, Key=key, UploadId=upload, PartNumber=number, Body=body
                    )
                except BaseException:
                    failed = True
                    raise
            return {"PartNumber": number, "ETag": out["ETag"]}

        offsets = range(0, len(data), part_size)
        results = await asyncio.gather(
            *(part(i + 1, offset) for i, offset in enumerate(offsets)), return_exceptions=True
        )
        parts = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            assert result is not None  # None only after a failure, raised above
            parts.append(result)
        return parts

    async def _abort(self, path: str, key: str, upload: str) -> None:
        """Abort an upload that will not complete; remember it when that fails too."""
        try:
            await self._call("abort_multipart_upload", path, Key=key, UploadId=upload)
        except RequestFailed as failed:
            if failed.kind == "missing":
                return
            with self._lock:
                self._orphans[upload] = (path, key)
            log.warning(
                "could not abort multipart upload %s of %s (%s); it is aborted before the next "
                "write. An AbortIncompleteMultipartUpload lifecycle rule on the bucket also "
                "removes uploads that crashed writers leave behind",
                upload,
                self._name(path),
                redact(failed.detail, self._secrets),
            )

    async def _abort_orphans(self) -> None:
        with self._lock:
            orphans = dict(self._orphans)
        for upload, (path, key) in orphans.items():
            with self._lock:
                self._orphans.pop(upload, None)
            await self._abort(path, key, upload)  # puts it back when it fails again

    async def _list_uploads(self) -> builtins.list[tuple[str, str]]:
        kw: dict[str, Any] = {"Prefix": f"{self.prefix}/" if self.prefix else ""}
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: builtins.list[tuple[str, str]] = []
        while True:
            page = await self._call("list_multipart_uploads", "", **kw)
            out.extend((u["Key"][strip:], u["UploadId"]) for u in page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return sorted(out)
            kw["KeyMarker"] = page.get("NextKeyMarker")
            kw["UploadIdMarker"] = page.get("NextUploadIdMarker")
