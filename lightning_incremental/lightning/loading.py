"""``load_from_checkpoint`` for checkpoints written by :class:`IncrementalCheckpointIO`.

Lightning's ``MyModel.load_from_checkpoint(path)`` reads ``path`` with ``torch.load``; with the
plug-in, ``path`` (``trainer.checkpoint_callback.best_model_path``, say) is a small pointer file
naming a checkpoint in the store next to it, which ``torch.load`` cannot read. The one-liner::

    import lightning_incremental as li

    model = li.load_from_checkpoint(MyModel, trainer.checkpoint_callback.best_model_path)
    datamodule = li.load_from_checkpoint(MyDataModule, path)

takes the same arguments as ``LightningModule.load_from_checkpoint`` /
``LightningDataModule.load_from_checkpoint`` and returns what they return: the checkpoint is
read through :class:`~lightning_incremental.IncrementalCheckpointIO` (pointer files, store
directories, and plain ``torch.save`` files alike), then Lightning's own steps follow — legacy
migration, ``hparams_file``, ``**kwargs`` overriding the saved hyper-parameters, instantiation,
``strict`` state-dict loading, and moving the model to the device of the loaded tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml
from lightning.pytorch.utilities.migration import pl_legacy_patch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_incremental.core import PickleNotAllowedError
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning.checkpoint_io import IncrementalCheckpointIO
from lightning_incremental.lightning.compat import MapLocation, PathLike

__all__ = ["load_from_checkpoint"]

T = TypeVar("T", "pl.LightningModule", "pl.LightningDataModule")


def load_from_checkpoint(
    cls: type[T],
    checkpoint_path: PathLike | IO[bytes],
    map_location: MapLocation = None,
    hparams_file: PathLike | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for checkpoints written by
    :class:`~lightning_incremental.IncrementalCheckpointIO`.

    Args:
        cls: a ``LightningModule`` or ``LightningDataModule`` subclass.
        checkpoint_path: a pointer file written by the plug-in (``best_model_path``,
            ``last.ckpt``), a store directory (its newest checkpoint), a plain ``torch.save``
            checkpoint, or an open binary file of one (read with ``torch.load``).
        map_location: as Lightning's: by default every tensor goes to the device it was saved
            on, or to the CPU when that device is not available; otherwise exactly
            ``torch.load``'s ``map_location``.
        hparams_file: a ``.yaml`` or ``.csv`` file whose hyper-parameters replace the saved
            ones, as Lightning's.
        strict: as Lightning's (``LightningModule`` only): whether the state dict's keys must
            match the model's exactly; None: the model's ``strict_loading``.
        weights_only: ``False`` trusts the checkpoint: values that only pickle can hold (saved
            with ``IncrementalCheckpointIO(allow_pickle=True)``) are loaded. Otherwise they are
            refused, as ``torch.load(weights_only=True)`` refuses them.
        storage_options: fsspec options (credentials, endpoint) for paths that are URLs.
        **kwargs: override the saved hyper-parameters (arguments of ``cls.__init__``).

    Returns:
        The restored ``cls`` instance (a ``LightningModule`` in eval-ready state on the device
        of the loaded tensors, as Lightning returns it).

    Raises:
        TypeError: ``cls`` is not a ``LightningModule`` or ``LightningDataModule`` subclass.
        FileNotFoundError: no checkpoint at ``checkpoint_path`` (``CheckpointNotFoundError``
            for a pointer whose checkpoint is not committed or whose store is missing).
        PickleNotAllowedError: the checkpoint holds pickles and ``weights_only`` is not False.
        RuntimeError: the state dict does not fit the model (with ``strict``), as Lightning's.
        ValueError: a bad ``hparams_file`` extension, as Lightning's.
    """
    if not (
        isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))
    ):
        raise TypeError(
            "load_from_checkpoint(cls, path, ...) takes a LightningModule or LightningDataModule "
            f"class as its first argument, got {cls!r}"
        )
    map_location = map_location or _compat.default_map_location
    with pl_legacy_patch():
        checkpoint = _read(checkpoint_path, map_location, weights_only, storage_options)
    checkpoint = _compat.migrate_checkpoint(
        checkpoint,
        path=(checkpoint_path if isinstance(checkpoint_path, (str, Path)) else None),
    )
    if hparams_file is not None:
        extension = str(hparams_file).split(".")[-1].lower()
        if extension == "csv":
            hparams = load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            hparams = load_hparams_from_yaml(hparams_file)
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)

    if issubclass(cls, pl.LightningDataModule):
        return _compat.load_state(cls, checkpoint, **kwargs)  # type: ignore[return-value]
    model = _compat.load_state(cls, checkpoint, strict=strict, **kwargs)
    assert isinstance(model, pl.LightningModule)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        rank_zero_warn(f"The state dict in {checkpoint_path!r} contains no parameters.")
        return model
    device = next(
        (t for t in state_dict.values() if isinstance(t, torch.Tensor)), torch.tensor(0)
    ).device
    return model.to(device)


def _read(
    checkpoint_path: PathLike | IO[bytes],
    map_location: MapLocation,
    weights_only: bool | None,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    if not isinstance(checkpoint_path, (str, Path)) and not hasattr(checkpoint_path, "__fspath__"):
        # an open file: only torch.save files can be read from one
        return torch.load(
            checkpoint_path,
            map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only,
        )
    reader = IncrementalCheckpointIO(
        storage_options=storage_options, allow_pickle=weights_only is False
    )
    try:
        return reader.load_checkpoint(
            checkpoint_path,  # type: ignore[arg-type]
            map_location=map_location,
            weights_only=weights_only,
        )
    except PickleNotAllowedError as exc:
        raise PickleNotAllowedError(
            f"{exc}; with load_from_checkpoint, pass weights_only=False to load it (only if you "
            "trust this checkpoint: loading a pickle executes code)"
        ) from exc
    finally:
        reader.close()
