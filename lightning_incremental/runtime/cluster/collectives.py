"""The process group as the adapters see it: is one up, who am I, gather, broadcast, barrier.

One wrapper over ``torch.distributed`` (as ``torch.distributed.checkpoint``'s ``_DistWrapper``):
every function works unchanged without a process group (``torch.distributed`` unavailable, not
initialised, or a group of one), where it is the identity on this process's value. Under a
process group each is a collective: every rank of ``group`` must call it, in the same order.

Object collectives pickle their values; with NCCL the current CUDA device must be set
(``torch.cuda.set_device``), as for any ``*_object`` collective — Lightning's DDP strategy and
Accelerate set it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


def is_distributed(group: Any = None) -> bool:
    """Whether ``group`` (default: the world) is an initialised process group of more than one
    process: whether the functions below communicate."""
    return world_size(group) > 1


def world_size(group: Any = None) -> int:
    """The size of ``group``; 1 without an initialised process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def rank(group: Any = None) -> int:
    """This process's rank within ``group``; 0 without an initialised process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(group))


def gather(value: T, group: Any = None) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` alone)."""
    size = world_size(group)
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, value, group=group)
    return out


def gather_to(value: T, dst: int = 0, group: Any = None) -> list[T] | None:
    """Every rank's ``value``, in rank order, on rank ``dst`` of ``group`` (None elsewhere;
    ``[value]`` alone). Each rank sends its own value only: at N ranks, :func:`gather` has every
    rank receive N values."""
    size = world_size(group)
    if size == 1:
        return [value]
    dist = torch.distributed
    root = dist.get_global_rank(group, dst) if group is not None else dst
    out: list[Any] | None = [None] * size if rank(group) == dst else None
    dist.gather_object(value, out, dst=root, group=group)
    return out


def broadcast(value: T, src: int = 0, group: Any = None) -> T:
    """Rank ``src``'s ``value`` (its rank within ``group``) on every rank; the other ranks'
    ``value`` is ignored (``value`` alone)."""
    if world_size(group) == 1:
        return value
    dist = torch.distributed
    root = dist.get_global_rank(group, src) if group is not None else src
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=root, group=group)
    shared: T = box[0]
    return shared


def barrier(group: Any = None) -> None:
    """Wait until every rank of ``group`` got here (nothing alone)."""
    if world_size(group) > 1:
        torch.distributed.barrier(group=group)


def any_true(flag: bool, device: Any = None, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (an all-reduce, MAX, of one small
    tensor); ``flag`` alone. ``device``: where the tensor lives — with NCCL the current CUDA
    device (the default there), with gloo the CPU (the default otherwise)."""
    if world_size(group) == 1:
        return bool(flag)
    dist = torch.distributed
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    box = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return bool(box.item())
