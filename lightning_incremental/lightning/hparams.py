"""OmegaConf hyper-parameters (what a Hydra script passes to ``save_hyperparameters``) in a
saved checkpoint: :func:`plain_hyperparameters` turns every ``DictConfig`` / ``ListConfig`` of
``hyper_parameters`` and ``datamodule_hyper_parameters`` into the plain dicts and lists it holds
(``OmegaConf.to_container(resolve=False)``: interpolations stay as written, so
``OmegaConf.create`` of the saved value is the same configuration), records where each one was
(:data:`MARK`), and a saved ``hparams_type`` class becomes its qualified name: no pickling needed.
:func:`typed_hyperparameters`, on every load path, turns them back into OmegaConf containers and
the type back into the class, so that Lightning rebuilds the module's configuration as from a
``torch.save`` file (``cfg.model.hidden`` keeps working). A structured config (backed by a
dataclass or attrs class) or one holding an enum is left as is: plain containers would lose its
types (it then needs ``allow_pickle=True``, as before). OmegaConf is imported only where it is
already loaded when saving (no ``DictConfig`` can exist otherwise), and when loading only where
the checkpoint says it held OmegaConf values.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
MARK = "lightning_incremental_omegaconf"  # where the OmegaConf containers were: key paths
Path = list[Any]  # keys from the checkpoint's top level (str for dicts, int for lists)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its OmegaConf hyper-parameters as plain containers (in place)."""
    if "omegaconf" not in sys.modules:
        return checkpoint
    converted: list[Path] = []
    for key in _KEYS:
        if key in checkpoint:
            checkpoint[key] = _plain(checkpoint[key], [key], converted)
    for key in _TYPE_KEYS:
        kind = checkpoint.get(key)
        if isinstance(kind, type) and kind.__module__.startswith("omegaconf"):
            checkpoint[key] = f"{kind.__module__}.{kind.__qualname__}"
    if converted:
        checkpoint[MARK] = converted
    return checkpoint


def typed_hyperparameters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`plain_hyperparameters` on a loaded ``checkpoint`` (in place): its recorded
    plain containers become OmegaConf containers again, an OmegaConf ``hparams_type`` name the
    class. Without OmegaConf installed they stay plain (Lightning then gives an AttributeDict)."""
    paths = checkpoint.pop(MARK, None)
    if not paths:
        return checkpoint
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return checkpoint
    for path in paths:
        *parents, last = path
        holder: Any = checkpoint
        for key in parents:
            holder = holder[key]
        holder[last] = OmegaConf.create(holder[last])
    for key in _TYPE_KEYS:
        name = checkpoint.get(key)
        if isinstance(name, str) and name.startswith("omegaconf."):
            module, _, cls = name.rpartition(".")
            checkpoint[key] = getattr(importlib.import_module(module), cls)
    return checkpoint


def _plain(value: Any, path: Path, converted: list[Path]) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode

    if isinstance(value, (DictConfig, ListConfig)):
        # structured configs come out as their dataclass instances, enums as enums: not plain
        plain = OmegaConf.to_container(
            value, resolve=False, structured_config_mode=SCMode.INSTANTIATE
        )
        if not _is_plain(plain):
            return value
        converted.append(path)
        return plain
    if type(value) is dict:
        return {k: _plain(v, [*path, k], converted) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v, [*path, i], converted) for i, v in enumerate(value)]
    if type(value) is tuple:  # converted, not recorded: a tuple cannot be refilled in place
        return tuple(_plain(v, [*path, i], []) for i, v in enumerate(value))
    return value


def _is_plain(value: Any) -> bool:
    if type(value) is dict:
        return all(type(k) in _SCALARS and _is_plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_is_plain(v) for v in value)
    return value is None or type(value) in _SCALARS


_SCALARS = (str, int, float, bool, bytes)
