"""DPPF, Distributed Pull-Push Force (Dimlioglu, Choromanska, arXiv 2507.20424): what a
round does to each worker around the workers' average (or the new consensus) x_bar::

    d_i   <- x_i - x_bar,   r_i <- ||d_i||
    x_i   <- x_i - pull*d_i + push*d_i / max(r_i, eps)

The distance to the average settles near ``push / pull``, so that ratio sets the width of the
valley the workers span. ``pull=1, push=0`` is plain averaging (PyTorch's
``PeriodicModelAverager``, bit for bit), ``push=0`` alone elastic averaging.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from signmuon.comm_hooks.dist import gather_rows, group_device, group_size_rank, split_like

__all__ = ["pull_push", "push_away", "worker_distances"]


def pull_push(
    tensors: list[torch.Tensor],
    flat: torch.Tensor,
    target: torch.Tensor,
    pull: float,
    push: float,
    eps: float,
    *,
    per_tensor: bool,
) -> list[float]:
    """Move ``tensors`` (whose flat copy is ``flat``) toward ``target`` by ``pull`` and away from
    it by ``push``; returns this worker's distance(s) r_i to ``target`` before the move."""
    diffs = [] if push else None
    for p, x_bar in zip(tensors, split_like(target, tensors)):
        if diffs is not None:
            diffs.append(p - x_bar)
        # lerp is exact at weight 1, so pull=1, push=0 gives torch's average bit for bit.
        p.lerp_(x_bar.to(p.dtype), pull)
    if diffs is None:
        return [float((flat - target).norm())]
    return push_away(tensors, diffs, push, eps, per_tensor=per_tensor)


def push_away(
    tensors: list[torch.Tensor], diffs: list[torch.Tensor], push: float, eps: float, *, per_tensor: bool
) -> list[float]:
    """``x_i += push * d_i / max(r_i, eps)`` with r_i the norm of all ``diffs`` together, or of each
    on its own where ``per_tensor``; returns the r_i."""
    if not per_tensor:
        r = math.sqrt(sum(float(d.double().pow(2).sum()) for d in diffs))
        for p, d in zip(tensors, diffs):
            p.add_(d, alpha=push / max(r, eps))
        return [r]
    radii = []
    for p, d in zip(tensors, diffs):
        r = float(d.norm())
        p.add_(d, alpha=push / max(r, eps))
        radii.append(r)
    return radii


def worker_distances(distances: list[float], group: dist.ProcessGroup, gather: bool) -> tuple[float, float]:
    """(mean, max) over the workers of each one's distance to the consensus (the root sum of
    squares of ``distances``); this worker's alone unless ``gather``."""
    mine = math.sqrt(sum(r * r for r in distances))
    world_size, _ = group_size_rank(group)
    if not gather or world_size == 1:
        return mine, mine
    gathered = gather_rows(torch.tensor([mine], dtype=torch.float64, device=group_device(group)), group)
    return float(gathered.mean()), float(gathered.max())
