"""A cloud provider's preemption notice, polled: :class:`MetadataPoller` turns it into a
:meth:`~lightning_incremental.runtime.policy.preemption.Preemption.request` (the same request a
signal makes)."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from lightning_incremental.core.errors import ConfigError

if TYPE_CHECKING:
    from lightning_incremental.runtime.policy.preemption import Preemption

log = logging.getLogger("lightning_incremental")

AWS_NOTICE = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCP_NOTICE = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"


class MetadataPoller:
    """Polls a cloud provider's preemption notice and turns it into a :meth:`Preemption.request`.

    Off by default (an HTTP request every ``interval_s`` on a daemon thread). ``provider``:
    ``"aws"`` (the spot ``instance-action`` document: 200 once a stop is scheduled), ``"gcp"``
    (``instance/preempted``: ``TRUE``), or a URL (tests, proxies) read the AWS way unless its
    body is ``TRUE``/``FALSE``. Every request has a timeout; errors other than "no notice"
    (404) are logged once and polling goes on.
    """

    def __init__(
        self,
        preemption: Preemption,
        provider: str = "aws",
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
    ) -> None:
        urls = {"aws": AWS_NOTICE, "gcp": GCP_NOTICE}
        self.url = urls.get(provider, provider)
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"preemption notice: 'aws', 'gcp' or an http(s) URL, got {provider!r}"
            )
        self.headers = {"Metadata-Flavor": "Google"} if provider == "gcp" else {}
        self.preemption, self.interval_s, self.timeout_s = preemption, interval_s, timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._complained = False

    def start(self) -> MetadataPoller:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="li-preemption-notice", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s + 1.0)

    def poll(self) -> str | None:
        """One look: the notice's text, or None when there is none."""
        request = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(65536).decode("utf-8", "replace").strip()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # AWS: no stop scheduled
                return None
            raise
        if body.upper() == "FALSE" or not body:
            return None
        if body.upper() == "TRUE":
            return "the instance is being preempted"
        try:
            doc = json.loads(body)
        except ValueError:
            return body[:200]
        if isinstance(doc, dict):
            return f"{doc.get('action', 'stop')} at {doc.get('time', 'soon')}"
        return body[:200]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.poll()
            except Exception as exc:  # unreachable metadata service: say so once, keep trying
                if not self._complained:
                    self._complained = True
                    log.warning("cannot read the preemption notice at %s: %s", self.url, exc)
                notice = None
            if notice is not None:
                self.preemption.request(f"cloud preemption notice: {notice}")
                return
            self._stop.wait(self.interval_s)


__all__ = ["AWS_NOTICE", "GCP_NOTICE", "MetadataPoller"]
