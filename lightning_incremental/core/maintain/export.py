"""Export a restored checkpoint as a plain file that loads without this library.

Formats:
- ``torch``: ``torch.save`` of the whole state (loads with ``torch.load(weights_only=True)``).
- ``lightning``: the same file, for a state that is a Lightning checkpoint (``state_dict``
  present); ``Trainer.fit(ckpt_path=...)`` and ``Model.load_from_checkpoint`` accept it.
- ``safetensors``: every tensor of the state, keyed by its dotted path (``state_dict.0.weight``);
  plain values are not tensors and are left out (safetensors holds tensors only). Two tensors
  whose dotted paths are one (``{0: a, "0": b}``) are refused, never one dropped.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core.errors import ConfigError, UnsupportedValueError
from lightning_incremental.core.format.tree import key_path

FORMATS = ("torch", "lightning", "safetensors")

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def export_state(state: dict[str, Any], to: str | os.PathLike[str], fmt: str) -> int:
    """Write ``state`` to ``to`` in format ``fmt``; returns the bytes written.

    Raises:
        ConfigError: unknown format, or a ``lightning`` export of a non-Lightning state.
        UnsupportedValueError: a tensor safetensors cannot hold, naming its key; two tensors
            with one safetensors name, naming both.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    path = Path(to)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "lightning" and "state_dict" not in state:
        raise ConfigError(
            "this checkpoint is not a Lightning checkpoint (no 'state_dict' key); "
            "use --format torch"
        )
    if fmt in ("torch", "lightning"):
        torch.save(state, tmp)
    else:
        write_safetensors(_named_tensors(state), tmp)
    os.replace(tmp, path)
    return path.stat().st_size


def _named_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by its dotted name.

    Raises:
        UnsupportedValueError: two tensors whose names are one (``{0: a, "0": b}``, or
            ``{"a.b": x, "a": {"b": y}}``), naming both key paths.
    """
    named: dict[str, torch.Tensor] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for name, path, tensor in _tensors(state, "", ()):
        if name in named:
            raise UnsupportedValueError(
                f"tensors {key_path(paths[name])} and {key_path(path)} both have the "
                f"safetensors name {name!r} (names are the dotted key paths, and must differ): "
                "rename a key, or use --format torch"
            )
        named[name], paths[name] = tensor, path
    return named


def _tensors(value: Any, prefix: str, path: tuple[Any, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        yield prefix, path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key), (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}" if prefix else str(index), (*path, index))


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` (by name) to the safetensors file ``path``, durably. Each tensor is
    written from its own memory (a copy of one tensor at a time only where it is not a
    contiguous CPU tensor): exporting a state never holds a second copy of it.

    Raises:
        UnsupportedValueError: a dtype safetensors cannot hold, naming the tensor.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        code = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if code is None:
            raise UnsupportedValueError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold; "
                "use --format torch"
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)))
            fh.write(text)
            for tensor in tensors.values():
                if tensor.numel():
                    data = tensor.detach().resolve_neg().cpu().contiguous()
                    fh.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                    del data
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # a file cut short is no export
        raise
