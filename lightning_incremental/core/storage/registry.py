"""Which backend opens which URL: a registry of URL schemes, filled by this library, by code
(:func:`register_scheme`) and by installed packages (the entry-point group
:data:`ENTRY_POINT_GROUP`).

A backend is a factory ``factory(url, storage_options) -> Storage``. ``open_storage`` looks the
URL's scheme up; a scheme nobody registered is looked for among the installed packages' entry
points (read once, on the first such scheme, and each plug-in imported only when its scheme is
used); a scheme that is not there either goes to the fsspec backend
(:mod:`~lightning_incremental.core.storage.filesystem`) when fsspec knows it. Backends are
imported lazily: importing the registry imports none of them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import fsspec

from lightning_incremental.core.errors import CheckpointError, ConfigError, StorageError
from lightning_incremental.core.storage.base import Storage
from lightning_incremental.core.storage.filesystem import open_fsspec
from lightning_incremental.core.storage.local import LocalStorage
from lightning_incremental.core.storage.redaction import redact, secret_strings

log = logging.getLogger("lightning_incremental")

#: The entry-point group through which an installed package adds a backend: the entry point's
#: name is the URL scheme, its value a factory ``factory(url, storage_options) -> Storage``.
ENTRY_POINT_GROUP = "lightning_incremental.storage"

StorageFactory = Callable[[str, dict[str, Any]], Storage]

_URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
_SCHEME_NAME = re.compile(r"^[a-z][a-z0-9+.\-]*$")


@dataclass(frozen=True)
class Backend:
    """One registered scheme: its factory (or where to import it from) and, for messages, how
    to install what it needs and which plug-in provides it."""

    scheme: str
    target: StorageFactory | metadata.EntryPoint  # an entry point is loaded on first use
    install_hint: str | None = None
    plugin: str | None = None  # "name = module:attr (distribution)" of a plug-in
    rival: str | None = None  # another plug-in claiming the same scheme

    @property
    def source(self) -> str:
        """Where the factory is: ``module:attribute``."""
        if isinstance(self.target, metadata.EntryPoint):
            return self.target.value
        module = getattr(self.target, "__module__", "?")
        return f"{module}:{getattr(self.target, '__qualname__', repr(self.target))}"

    def factory(self) -> StorageFactory:
        """The factory, imported now if it is given as ``module:attribute``.

        Raises:
            ConfigError: what it needs is not installed, or a plug-in that is broken.
        """
        if self.rival is not None:
            raise ConfigError(
                f"two installed packages provide a storage backend for {self.scheme}://: "
                f"{self.plugin} and {self.rival}; uninstall one of them"
            )
        if not isinstance(self.target, metadata.EntryPoint):
            return self.target
        try:
            loaded = self.target.load()
        except ImportError as exc:
            if self.plugin is not None:
                raise self._broken(f"{type(exc).__name__}: {exc}") from exc
            hint = f" ({self.install_hint})" if self.install_hint else ""
            raise ConfigError(f"no backend for {self.scheme}:// is installed{hint}: {exc}") from exc
        except Exception as exc:
            raise self._broken(f"{type(exc).__name__}: {exc}") from exc
        if not callable(loaded):
            raise self._broken(f"{self.target.value} is a {type(loaded).__name__}, not callable")
        factory: StorageFactory = loaded
        return factory

    def open(self, url: str, options: dict[str, Any]) -> Storage:
        """The storage at ``url``.

        Raises:
            ConfigError: see :meth:`factory`; a plug-in that fails or returns no Storage.
            StorageError: a plug-in's OSError (the location cannot be reached).
        """
        factory = self.factory()
        if self.plugin is None:
            return factory(url, options)
        try:
            storage = factory(url, options)
        except CheckpointError:  # ConfigError, StorageError: the plug-in's own words
            raise
        except Exception as exc:  # its message may quote an option's value
            secrets = secret_strings(options)
            message = (
                f"the storage backend for {self.scheme}:// ({self.plugin}) could not open "
                f"{url!r}: {redact(f'{type(exc).__name__}: {exc}', secrets)}"
            )
            error: CheckpointError
            if not isinstance(exc, OSError):
                error = ConfigError(f"{message}; fix or uninstall that package")
            elif exc.errno is None:
                error = StorageError(message)
            else:
                error = StorageError(exc.errno, message)
            raise error from (None if secrets else exc)
        if not isinstance(storage, Storage):
            raise self._broken(f"it returned a {type(storage).__name__}, not a Storage")
        return storage

    def _broken(self, what: str) -> ConfigError:
        origin = self.plugin or self.source
        return ConfigError(
            f"the storage backend for {self.scheme}:// ({origin}, entry-point group "
            f"{ENTRY_POINT_GROUP!r}) is broken: {what}; fix or uninstall that package"
        )


_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_discovered = False


def register_scheme(
    scheme: str,
    factory: StorageFactory | str,
    *,
    install_hint: str | None = None,
    replace: bool = False,
) -> None:
    """Open URLs of ``scheme`` with ``factory(url, storage_options) -> Storage``.

    Args:
        scheme: the URL scheme, without ``://`` (case-insensitive).
        factory: the factory, or ``"module:attribute"`` to import it on first use.
        install_hint: what to install when importing it fails (``"pip install ..."``).
        replace: replace a backend registered for ``scheme`` before.

    Raises:
        ConfigError: a bad scheme or factory, or a scheme registered already (without
            ``replace``).
    """
    if not isinstance(scheme, str) or not _SCHEME_NAME.match(scheme.lower()):
        raise ConfigError(
            f"a URL scheme is a letter then letters, digits, '+', '-', '.', got {scheme!r}"
        )
    scheme = scheme.lower()
    target: StorageFactory | metadata.EntryPoint
    if isinstance(factory, str):
        if ":" not in factory:
            raise ConfigError(f"factory must be callable or 'module:attribute', got {factory!r}")
        target = metadata.EntryPoint(name=scheme, value=factory, group=ENTRY_POINT_GROUP)
    elif callable(factory):
        target = factory
    else:
        raise ConfigError(f"factory must be callable or 'module:attribute', got {factory!r}")
    with _lock:
        existing = _backends.get(scheme)
        if existing is not None and existing.plugin is None and not replace:
            raise ConfigError(
                f"a storage backend for {scheme}:// is registered already; pass replace=True "
                "to replace it"
            )
        _backends[scheme] = Backend(scheme, target, install_hint)


def unregister_scheme(scheme: str) -> None:
    """Forget the backend of ``scheme`` (its URLs then go to fsspec's backend, if any)."""
    with _lock:
        _backends.pop(scheme.lower(), None)


def registered_schemes() -> list[str]:
    """Every scheme with a backend of its own: registered, or provided by an installed
    package (the entry-point group is read now if it was not before)."""
    _discover()
    with _lock:
        return sorted(_backends)


def backend_for(scheme: str) -> Backend | None:
    """The backend registered for ``scheme``, or None (fsspec's backend then, if any)."""
    scheme = scheme.lower()
    with _lock:
        found = _backends.get(scheme)
    if found is None:
        _discover()
        with _lock:
            found = _backends.get(scheme)
    return found


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Storage:
    """The storage for ``url``: a local path, ``file://``, a scheme with a registered backend
    (``s3://`` and ``s3a://`` get :class:`~lightning_incremental.core.storage.s3.S3Storage`,
    plug-ins theirs), or any other fsspec URL.

    ``storage_options`` reach the backend and nothing else: no message, log record or stored
    object of this library contains one of their values.

    Raises:
        ConfigError: unknown protocol, a backend that is not installed or is broken, bad
            storage options.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url must be a non-empty str or path, got {url!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    options = dict(storage_options or {})
    match = _URL_SCHEME.match(url)
    if match is None:
        if options:
            raise ConfigError("storage_options were given for a local path; they apply to URLs")
        return LocalStorage(os.path.abspath(os.path.expanduser(url)))
    scheme = match.group(1).lower()
    found = backend_for(scheme)
    if found is not None:
        return found.open(url, options)
    if scheme not in fsspec.available_protocols():
        raise ConfigError(_unknown(scheme, url))
    return open_fsspec(url, options)


def _unknown(scheme: str, url: str) -> str:
    fsspec_known = sorted(p for p in fsspec.available_protocols() if len(p) > 1)
    return (
        f"unknown storage protocol {scheme!r} in {url!r}: no backend is registered for it "
        f"(registered: {', '.join(registered_schemes()) or 'none'}) and fsspec does not know it "
        f"(fsspec knows: {', '.join(fsspec_known[:40])}). A package adds a backend through the "
        f"entry-point group {ENTRY_POINT_GROUP!r}"
    )


def _discover() -> None:
    """Register every backend of the entry-point group, once (imports none of them)."""
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True
        for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            _add_plugin(point)


def _add_plugin(point: metadata.EntryPoint) -> None:
    scheme = point.name.lower()
    dist = getattr(point, "dist", None)
    label = f"{point.name} = {point.value}" + (
        f" ({dist.name} {dist.version})" if dist is not None else ""
    )
    if not _SCHEME_NAME.match(scheme):
        log.warning("ignoring the storage plug-in %s: %r is not a URL scheme", label, point.name)
        return
    existing = _backends.get(scheme)
    if existing is None:
        _backends[scheme] = Backend(scheme, point, plugin=label)
    elif existing.plugin is None:
        log.warning(
            "ignoring the storage plug-in %s: %s:// has a backend registered already", label, scheme
        )
    elif existing.target != point:
        _backends[scheme] = Backend(
            scheme, existing.target, plugin=existing.plugin, rival=existing.rival or label
        )


register_scheme(
    "s3",
    "lightning_incremental.core.storage.s3:S3Storage.from_url",
    install_hint="pip install 'lightning-incremental[s3]'",
)
register_scheme(
    "s3a",
    "lightning_incremental.core.storage.s3:S3Storage.from_url",
    install_hint="pip install 'lightning-incremental[s3]'",
)
