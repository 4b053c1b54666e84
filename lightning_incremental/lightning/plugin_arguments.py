"""The checks on :class:`~.checkpoint_io.IncrementalCheckpointIO`'s constructor arguments that
no other part checks (the store options are :class:`~lightning_incremental.core.StoreConfig`'s,
``materialize`` is :func:`~.materialize.materialize_option`'s)."""

from __future__ import annotations

from typing import Any

from lightning_incremental.core import ConfigError
from lightning_incremental.lightning.pointers import valid_store_name


def check_plugin_arguments(
    storage_options: Any, store_name: Any, allow_pickle: Any, options: dict[str, Any]
) -> None:
    """Raises:
    TypeError: ``storage_options`` is not a dict or None.
    ConfigError: an invalid ``store_name`` or ``allow_pickle``, or ``keep_last`` among the
        store ``options``.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(
            f"storage_options must be a dict of fsspec options or None, got "
            f"{type(storage_options).__name__}"
        )
    if not isinstance(store_name, str) or not valid_store_name(store_name):
        raise ConfigError(
            f"store_name must be one plain directory name (letters, digits, '_', '-', '.'; "
            f"not '.' or '..'), got {store_name!r}"
        )
    if "keep_last" in options:
        raise ConfigError(
            "keep_last is not an option of IncrementalCheckpointIO: checkpoints are kept or "
            "removed by Lightning (ModelCheckpoint(save_top_k=...)); the store keeps exactly "
            "the checkpoints that files point to"
        )
    if not isinstance(allow_pickle, bool):
        raise ConfigError(f"allow_pickle must be True or False, got {allow_pickle!r}")
