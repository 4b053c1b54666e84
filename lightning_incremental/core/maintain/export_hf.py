"""Export a model's weights as Hugging Face's ``save_pretrained`` writes them, so that
``from_pretrained(folder)`` loads them once the model's small files (``config.json`` ...) are
beside them.

One ``model.safetensors`` (metadata ``{"format": "pt"}``), or, past ``max_shard_size`` bytes,
``model-00001-of-0000N.safetensors`` shards in the order of the state dict (a tensor bigger than
the limit in a shard of its own) with ``model.safetensors.index.json`` mapping every name to its
shard. Weight files of an earlier export that this one does not replace are removed, so a folder
never holds two sets. The file format needs no ``transformers``; the engine stays framework-free.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.core.maintain.export import write_safetensors

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: ``save_pretrained``'s default ``max_shard_size`` ("50GB": decimal units, as Hugging Face's).
DEFAULT_MAX_SHARD_SIZE = 50 * 10**9
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(value: int | str) -> int:
    """``max_shard_size`` as bytes: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (GB = 10**9,
    GiB = 2**30, as Hugging Face reads them).

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = found.group(2).upper() if found else None
        if found is None or unit not in _UNITS:
            raise ConfigError(
                f"max shard size {value!r} is not a size; give bytes or e.g. '5GB', '500MB'"
            )
        size = int(float(found.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"max shard size must be positive, got {value!r}")
    return size


def shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """The names of ``tensors`` in shards of at most ``max_shard_size`` bytes, in order (a
    tensor bigger than the limit alone in its shard)."""
    found: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if found[-1] and size + nbytes > max_shard_size:
            found.append([])
            size = 0
        found[-1].append(name)
        size += nbytes
    return found


def export_hf(
    tensors: dict[str, Any],
    to: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> tuple[list[str], int]:
    """Write the model weights ``tensors`` (a flat state dict) into the folder ``to``, as
    ``save_pretrained`` does; returns the files written (names) and their bytes.

    Raises:
        ConfigError: ``tensors`` is not a flat dict of tensors (naming the first other value),
            or a bad ``max_shard_size``.
        UnsupportedValueError: a dtype safetensors cannot hold, naming the tensor.
    """
    limit = parse_size(max_shard_size)
    for name, value in tensors.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"a model's weights are a flat dict of tensors; {name!r} holds "
                f"{type(value).__name__}"
            )
    folder = Path(to)
    folder.mkdir(parents=True, exist_ok=True)
    groups = shards(tensors, limit)
    if len(groups) == 1:
        names = [WEIGHTS]
    else:
        names = [
            f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
        ]
    written = 0
    for name, group in zip(names, groups):
        temporary = folder / f".{name}.tmp"
        write_safetensors({k: tensors[k] for k in group}, temporary)
        os.replace(temporary, folder / name)
        written += (folder / name).stat().st_size
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: name for name, group in zip(names, groups) for k in group},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        temporary = folder / f".{INDEX}.tmp"
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, folder / INDEX)
        written += len(text.encode())
        names.append(INDEX)
    for entry in os.listdir(folder):  # an earlier export's other set of weights
        if entry not in names and (entry in (WEIGHTS, INDEX) or _SHARD.fullmatch(entry)):
            os.remove(folder / entry)
    return names, written


def copy_beside(source: str | os.PathLike[str], to: str | os.PathLike[str],
                skip: set[str]) -> list[str]:  # fmt: skip
    """Copy the plain files of the folder ``source`` into ``to`` (created), except the names in
    ``skip`` and weight files; returns the names copied."""
    copied = []
    Path(to).mkdir(parents=True, exist_ok=True)
    for entry in sorted(os.listdir(source)):
        path = Path(source) / entry
        weights = entry in (WEIGHTS, INDEX) or _SHARD.fullmatch(entry)
        if entry in skip or weights or not path.is_file():
            continue
        shutil.copyfile(path, Path(to) / entry)
        copied.append(entry)
    return copied


def check_source_folder(folder: str | os.PathLike[str], step: int, record: str) -> None:
    """``folder`` is a directory whose JSON ``record`` file, if it has one, names ``step``
    (a Hugging Face Trainer's ``checkpoint-N`` folder written through the store).

    Raises:
        ConfigError: it is not, naming what it holds.
    """
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"--from-folder {folder} is not a directory")
    if not (path / record).is_file():
        return
    try:
        recorded = json.loads((path / record).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path / record} is not a readable checkpoint record: {exc}") from exc
    if recorded != step:
        raise ConfigError(
            f"--from-folder {folder} is the checkpoint of step {recorded}, not of step {step}: "
            f"export step {recorded}, or give the folder of step {step}"
        )
