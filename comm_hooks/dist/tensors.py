"""Tensor plumbing around collectives, written once: flatten a list of tensors and put the
result back, the full-precision mean all-reduce and its ring byte count, a finiteness flag."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .groups import group_size_rank
from .stats import CommStats

__all__ = ["all_reduce", "all_to_all", "flatten", "mean_all_reduce", "nonfinite_flag", "ring_bytes", "split_like", "unflatten_into"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after another (what a collective sends)."""
    if not tensors:
        raise ValueError("flatten() needs at least one tensor")
    return torch.cat([t.reshape(-1) for t in tensors])


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (the inverse of :func:`flatten`)."""
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s pieces back into ``tensors`` in place."""
    for t, piece in zip(tensors, split_like(flat, tensors)):
        t.copy_(piece)


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: ``2(M-1)/M · nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    *,
    op: str = "sum",
    inside_node: bool = False,
    async_op: bool = False,
):
    """In place: ``tensor`` becomes the ``op`` (``"sum"``, ``"max"`` or ``"min"``) over ``group``;
    the ring's bytes are added to ``stats`` (as bytes inside a node where ``inside_node``).
    Returns the work handle where ``async_op`` (None for a group of one), else ``tensor``."""
    world_size, _ = group_size_rank(group)
    if stats is not None:
        ring = ring_bytes(tensor.numel() * tensor.element_size(), world_size)
        stats.add(ring, ring, inside_node=inside_node)
    if world_size == 1:
        return None if async_op else tensor
    work = dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)
    return work if async_op else tensor


def all_to_all(
    send: torch.Tensor,
    send_splits: Sequence[int],
    receive_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    *,
    inside_node: bool = False,
) -> torch.Tensor:
    """Rank r gets ``send``'s r-th piece (``send_splits[r]`` entries, 1-D) from every rank: the
    pieces received, one after another by source rank (``receive_splits[s]`` entries from rank
    s). What crosses to other ranks is added to ``stats`` (as bytes inside a node where ``inside_node``)."""
    world_size, rank = group_size_rank(group)
    if world_size == 1:
        return send.clone()
    receive = send.new_empty(sum(receive_splits))
    dist.all_to_all_single(receive, send, output_split_sizes=list(receive_splits), input_split_sizes=list(send_splits), group=group)
    if stats is not None:
        size = send.element_size()
        sent = sum(n for r, n in enumerate(send_splits) if r != rank) * size
        received = sum(n for r, n in enumerate(receive_splits) if r != rank) * size
        stats.add(sent, received, inside_node=inside_node)
    return receive


def mean_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    *,
    inside_node: bool = False,
    async_op: bool = False,
):
    """In place: ``tensor`` becomes the mean over ``group``, in full precision.

    Each rank divides by the group size, then the all-reduce sums (DDP's and torch's
    ``average_parameters`` order). The ring's bytes are added to ``stats`` (as bytes inside a
    node where ``inside_node``). Returns the collective's work handle where ``async_op`` (None
    for a group of one), else ``tensor``.
    """
    world_size, _ = group_size_rank(group)
    if world_size > 1:
        tensor.div_(world_size)
    return all_reduce(tensor, group, stats, inside_node=inside_node, async_op=async_op)


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: does ``tensor`` hold NaN or ±Inf? (No host synchronisation on a GPU.)

    One summing pass (about half a memcpy): a sum is finite when every entry is, and an
    infinite sum of finite entries (overflow) is rare enough to settle with the entry-wise
    check only then. fp16 sums in float32, whose range its values cannot overflow.
    """
    if tensor.device.type != "cpu":  # one fused pass and no host synchronisation
        return ~torch.isfinite(tensor).all()
    total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
    bad = ~torch.isfinite(total)
    if bool(bad):
        bad = ~torch.isfinite(tensor).all()
    return bad
