"""A real S3 endpoint on loopback for the tests, and a proxy in front of it that injects faults.

- ``s3_endpoint`` (session): moto's standalone server (``python -m moto.server``, as s3fs's
  own suite runs it), on 127.0.0.1 with an ephemeral port, and a :class:`FaultProxy` forwarding
  to it. Nothing leaves loopback.
- ``s3_bucket``: a fresh bucket per test (unique name), removed with its contents afterwards.
- ``s3_faults``: the proxy's :class:`FaultPlan`, cleared after the test.

The proxy speaks HTTP/1.1 to the client and forwards each request to moto, unless a rule of the
plan matches it; then it answers an S3 error (500 InternalError, 503 SlowDown, ...), resets the
connection, stalls until the client times out, or forwards the request and drops the response
(the write landed but the client never hears so). Rules fire on the Nth matching request, a
number of times or for good — deterministic, nothing sleeps.
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

REGION = "us-east-1"
KEY, SECRET = "testing-key-id", "testing-secret"
STALL_MAX_S = 30.0  # a stalled request is released by the test's cleanup long before this
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
}
ERRORS = {  # status -> (code, message) as S3 sends them
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    501: ("NotImplemented", "A header you provided implies functionality that is not implemented"),
}
ACTIONS = ("error", "reset", "stall", "drop")


@dataclass
class Rule:
    """Requests this rule matches: ``method`` (None: any), ``key`` a substring of the path
    (None: any), ``query`` parameters that must be present (value None: any value), ``header``
    a header that must be present. The matching requests number ``skip + 1`` ..
    ``skip + times`` fail (``times=None``: for good)."""

    action: str
    method: str | None = None
    key: str | None = None
    query: dict[str, str | None] = field(default_factory=dict)
    header: str | None = None
    status: int = 500
    skip: int = 0
    times: int | None = 1
    seen: int = 0
    fired: int = 0

    def matches(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]
    ) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.key is not None and self.key not in path:
            return False
        if self.header is not None and self.header.lower() not in headers:
            return False
        for name, value in self.query.items():
            if name not in query or (value is not None and value not in query[name]):
                return False
        return True

    def fires(self) -> bool:
        self.seen += 1
        if self.seen <= self.skip:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


@dataclass(frozen=True)
class Seen:
    """A request that reached the proxy, and what the proxy did with it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    action: str  # "forward" or the rule's action


class FaultPlan:
    """The proxy's programmable fault schedule (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._release = threading.Event()
        self.requests: list[Seen] = []

    def add(self, action: str, **match: Any) -> Rule:
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        rule = Rule(action, **match)
        if action == "error" and rule.status not in ERRORS:
            raise ValueError(f"no S3 error for status {rule.status}")
        with self._lock:
            self._rules.append(rule)
        return rule

    def error(self, status: int = 500, **match: Any) -> Rule:
        """Answer an S3 error: 500 InternalError, 503 SlowDown, 403 AccessDenied, 404 NoSuchKey,
        501 NotImplemented."""
        return self.add("error", status=status, **match)

    def reset(self, **match: Any) -> Rule:
        """Read the request, then reset the connection (RST) without answering."""
        return self.add("reset", **match)

    def stall(self, **match: Any) -> Rule:
        """Read the request and never answer (until cleared): the client times out."""
        return self.add("stall", **match)

    def drop(self, **match: Any) -> Rule:
        """Forward the request (it takes effect), then reset instead of answering."""
        return self.add("drop", **match)

    def clear(self) -> None:
        """Remove every rule and release stalled requests; the log of requests stays."""
        with self._lock:
            self._rules.clear()
            release, self._release = self._release, threading.Event()
        release.set()

    def forget(self) -> None:
        """Empty the log of requests."""
        with self._lock:
            self.requests.clear()

    def pick(
        self, method: str, path: str, query: str, headers: dict[str, str]
    ) -> tuple[Rule | None, threading.Event]:
        parsed = parse_qs(query, keep_blank_values=True)
        with self._lock:
            chosen = None
            for rule in self._rules:
                if rule.matches(method, path, parsed, headers) and rule.fires():
                    chosen = rule
                    break
            action = chosen.action if chosen else "forward"
            self.requests.append(Seen(method, path, query, headers, action))
            return chosen, self._release

    def seen(
        self, method: str | None = None, key: str = "", action: str | None = None
    ) -> list[Seen]:
        """Requests so far: of ``method``, with ``key`` in the path, handled with ``action``
        ("forward" or a rule's action; None: any)."""
        with self._lock:
            return [
                seen
                for seen in self.requests
                if (action is None or seen.action == action)
                and (method is None or seen.method == method)
                and key in seen.path
            ]


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    upstream: tuple[str, int]
    plan: FaultPlan


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        body = self._read_body()
        headers = {name.lower(): value for name, value in self.headers.items()}
        rule, release = self.server.plan.pick(self.command, url.path, url.query, headers)
        if rule is None:
            self._forward(body)
        elif rule.action == "error":
            self._error(rule.status)
        elif rule.action == "reset":
            self._reset()
        elif rule.action == "stall":
            release.wait(STALL_MAX_S)
            self._reset()
        else:
            assert rule.action == "drop"
            self._forward(body, answer=False)
            self._reset()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes, *, answer: bool = True) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=STALL_MAX_S)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        if not answer:
            return
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else len(data)
        self.send_header("Content-Length", str(length or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int) -> None:
        code, message = ERRORS[status]
        data = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>fault-injected</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _reset(self) -> None:
        """Abort the connection with a TCP reset, as a crashing load balancer does."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()  # the socket closes (and resets) once no file object refers to it
        self.connection.close()


class FaultProxy:
    """An HTTP proxy on loopback in front of ``upstream`` that follows a :class:`FaultPlan`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.plan = FaultPlan()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.upstream = upstream
        self._server.plan = self.plan
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-fault-proxy", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.plan.clear()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@dataclass
class S3Endpoint:
    """The running endpoint: ``url`` is moto itself, ``proxy`` the faulty way to it."""

    url: str
    proxy: FaultProxy
    client: Any  # a boto3 S3 client on ``url``, to inspect and clean up behind the store's back

    def options(self, *, faulty: bool = False, **extra: Any) -> dict[str, Any]:
        """storage_options for s3fs; ``faulty`` goes through the fault proxy."""
        options: dict[str, Any] = {
            "endpoint_url": self.proxy.url if faulty else self.url,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }
        options.update(extra)
        return options

    def new_bucket(self) -> str:
        bucket = f"li-test-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=bucket)
        return bucket

    def objects(self, bucket: str) -> dict[str, bytes]:
        """Every object of ``bucket`` with its bytes."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                key = item["Key"]
                out[key] = self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return out

    def open_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload not completed or aborted."""
        page = self.client.list_multipart_uploads(Bucket=bucket)
        return [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]

    def drop_bucket(self, bucket: str) -> None:
        for key, upload in self.open_uploads(bucket):
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        for key in self.objects(bucket):
            self.client.delete_object(Bucket=bucket, Key=key)
        self.client.delete_bucket(Bucket=bucket)


@contextmanager
def s3_defaults(options: dict[str, Any]) -> Iterator[None]:
    """Make ``options`` fsspec's defaults for s3:// (``fsspec.config.conf``) meanwhile."""
    import fsspec.config

    saved = {name: fsspec.config.conf.get(name) for name in ("s3", "s3a")}
    fsspec.config.conf["s3"] = options
    fsspec.config.conf.pop("s3a", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                fsspec.config.conf.pop(name, None)
            else:
                fsspec.config.conf[name] = value


class MotoServer:
    """moto's standalone S3 server (``python -m moto.server``) in a subprocess on loopback, as
    s3fs's own suite runs it: on two cores, server and client then do not share one GIL. The
    port is the one the server reports it bound (port 0: any free one); nothing polls."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._process.stderr is not None
        said = []
        for line in self._process.stderr:  # blocks until the server says where it listens
            said.append(line)
            found = re.search(r"Running on (http://127\.0\.0\.1:\d+)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            self._process.wait()
            raise RuntimeError(f"moto's server did not start: {''.join(said)[-2000:]}")
        # keep reading its request log, or a full pipe would block the server
        self._drain = threading.Thread(
            target=self._process.stderr.read, name="moto-server-log", daemon=True
        )
        self._drain.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait()
        self._drain.join()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """moto's S3 server and the fault proxy, on loopback, for the whole session."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server = MotoServer()
    proxy: FaultProxy | None = None
    try:
        proxy = FaultProxy(server.address)
        proxy.start()
        client = boto3.client(
            "s3",
            endpoint_url=server.url,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name=REGION,
        )
        yield S3Endpoint(server.url, proxy, client)
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> Iterator[str]:
    """A new, empty bucket; removed (with whatever the test left in it) afterwards."""
    bucket = s3_endpoint.new_bucket()
    yield bucket
    s3_endpoint.drop_bucket(bucket)


@pytest.fixture
def s3_faults(s3_endpoint: S3Endpoint) -> Iterator[FaultPlan]:
    """The fault proxy's plan, empty; cleared (stalled requests released) after the test."""
    plan = s3_endpoint.proxy.plan
    plan.clear()
    plan.forget()
    yield plan
    plan.clear()
