"""Storage: one small interface (:class:`Storage`) over local disks, fsspec and S3, and the
registry that picks a backend by URL scheme.

- :mod:`.base`: the interface, and backend errors turned into this library's.
- :mod:`.local`, :mod:`.filesystem`, :mod:`.s3` (with :mod:`.s3_client`, :mod:`.retry`): the
  backends. ``s3`` needs s3fs and is imported only when an ``s3://`` URL is opened.
- :mod:`.registry`: ``open_storage``, ``register_scheme`` and the entry-point group
  ``lightning_incremental.storage`` for backends of other packages.
"""

from lightning_incremental.core.storage.base import Storage, translate_errors
from lightning_incremental.core.storage.filesystem import FsspecStorage, filesystem
from lightning_incremental.core.storage.local import TMP_PREFIX, LocalStorage
from lightning_incremental.core.storage.redaction import redact, secret_strings
from lightning_incremental.core.storage.registry import (
    ENTRY_POINT_GROUP,
    Backend,
    StorageFactory,
    backend_for,
    open_storage,
    register_scheme,
    registered_schemes,
    unregister_scheme,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "StorageFactory",
    "TMP_PREFIX",
    "backend_for",
    "filesystem",
    "open_storage",
    "redact",
    "register_scheme",
    "registered_schemes",
    "secret_strings",
    "translate_errors",
    "unregister_scheme",
]
