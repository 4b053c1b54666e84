"""OmegaConf hyper-parameters (what a Hydra script passes to ``save_hyperparameters``) in a
saved checkpoint: :func:`plain_hyperparameters` turns every ``DictConfig`` / ``ListConfig`` of
``hyper_parameters`` and ``datamodule_hyper_parameters`` into the plain dicts and lists it holds
(``OmegaConf.to_container(resolve=False)``: interpolations stay as written, so
``OmegaConf.create`` of the saved value is the same configuration), and a saved
``hparams_type`` class into its qualified name: no pickling needed. A structured config (backed
by a dataclass or attrs class) or one holding an enum is left as is: plain containers would lose
its types (it then needs ``allow_pickle=True``, as before). OmegaConf is
imported only where it is already loaded (no ``DictConfig`` can exist otherwise).
"""

from __future__ import annotations

import sys
from typing import Any

_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def plain_hyperparameters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its OmegaConf hyper-parameters as plain containers (in place)."""
    if "omegaconf" not in sys.modules:
        return checkpoint
    for key in _KEYS:
        if key in checkpoint:
            checkpoint[key] = _plain(checkpoint[key])
    for key in _TYPE_KEYS:
        kind = checkpoint.get(key)
        if isinstance(kind, type) and kind.__module__.startswith("omegaconf"):
            # Lightning's loader reads a string type as AttributeDict (a dict, attribute access)
            checkpoint[key] = f"{kind.__module__}.{kind.__qualname__}"
    return checkpoint


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode

    if isinstance(value, (DictConfig, ListConfig)):
        # structured configs come out as their dataclass instances, enums as enums: not plain
        plain = OmegaConf.to_container(
            value, resolve=False, structured_config_mode=SCMode.INSTANTIATE
        )
        return plain if _is_plain(plain) else value
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _is_plain(value: Any) -> bool:
    if type(value) is dict:
        return all(type(k) in _SCALARS and _is_plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_is_plain(v) for v in value)
    return value is None or type(value) in _SCALARS


_SCALARS = (str, int, float, bool, bytes)
