"""Exporting to safetensors writes each tensor from its own memory: a state of any size is
exported without a second copy of it in memory (a 4 GB tensor costs no 4 GB of bytes), and
the file holds exactly the tensors."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch

from lightning_incremental.core.maintain.export import write_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_every_kind_of_tensor_reads_back_exactly(tmp_path: Path) -> None:
    complex_values = torch.randn(4, dtype=torch.complex64)
    tensors = {
        "plain": torch.randn(3, 5),
        "strided": torch.arange(40.0).reshape(5, 8)[:, ::3],  # not contiguous
        "transposed": torch.randn(4, 6).t(),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "negative_view": complex_values.conj().imag,  # a real tensor with the negative bit
    }
    path = tmp_path / "out.safetensors"
    write_safetensors(tensors, path)
    back = safetensors_torch.load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        want = tensor.resolve_neg()
        assert back[name].dtype == want.dtype and back[name].shape == want.shape, name
        assert torch.equal(back[name], want), name


def test_no_copy_of_the_state_is_held_while_writing(tmp_path: Path) -> None:
    """Before, each tensor's bytes were copied out (``tobytes``) and all of them held until
    the file was written: a second copy of the state in memory, 64 MB here."""
    tensors = {f"w{i}": torch.randn(2 << 20) for i in range(8)}  # 8 x 8 MiB
    tracemalloc.start()
    try:
        write_safetensors(tensors, tmp_path / "out.safetensors")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB allocated while writing 64 MiB of tensors"
    back = safetensors_torch.load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_only_tensors_not_laid_out_contiguously_on_the_cpu_are_copied(tmp_path: Path) -> None:
    """Torch's own allocations are not Python's (tracemalloc does not see them): the tensor
    operations that make new memory are counted instead. One per tensor that needs a
    contiguous copy, none for the others, and never a copy of the whole state."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name in ("clone", "_to_copy", "cat", "empty", "empty_like", "new_empty", "copy"):
                self.made.append(name)
            return func(*args, **(kwargs or {}))

    tensors = {f"w{i}": torch.randn(1 << 16) for i in range(6)}
    tensors["strided"] = torch.randn(64, 64).t()
    with Allocations() as counted:
        write_safetensors(tensors, tmp_path / "out.safetensors")
    assert counted.made == ["clone"], counted.made  # the transposed tensor's contiguous copy
    back = safetensors_torch.load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_failed_export_leaves_no_file(tmp_path: Path) -> None:
    class Refusing(torch.Tensor):
        def cpu(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("device lost")

    good = torch.randn(8)
    bad = torch.randn(8).as_subclass(Refusing)
    path = tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError, match="device lost"):
        write_safetensors({"good": good, "bad": bad}, path)
    assert not path.exists()
