"""The Inverse Mean Valley flatness measure (DPPF paper, docs/design.md).

From the model's point x, along K random unit directions u, find the distance t at which the
loss first exceeds L(x) + delta; MV is the mean of those distances and Inv. MV = 1/MV.
Small Inv. MV = wide, flat valley.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["ValleyResult", "inverse_mean_valley"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValleyResult:
    """What :func:`inverse_mean_valley` measured."""

    mean_valley: float
    """MV: the mean distance at which the loss first exceeds L(x) + delta."""
    inverse_mean_valley: float
    """1 / MV."""
    distances: list[float]
    """The distance along each direction (``max_distance`` where it never exceeded)."""
    base_loss: float
    """L(x), the mean loss over the batches at the model's own point."""
    capped: int
    """How many directions reached ``max_distance`` without exceeding L(x) + delta."""


def _random_direction(params: list[torch.Tensor], gen: torch.Generator, filter_normalized: bool) -> list[torch.Tensor]:
    """A unit direction over all parameters (unit Frobenius norm over the whole model).

    ``filter_normalized`` first scales each filter (row of the output dimension) of each
    direction tensor to the norm of the same filter of the weights (Li et al., 2018), so
    the direction respects each layer's scale; biases and gains are left out (zero).
    """
    direction = []
    for p in params:
        d = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
        if filter_normalized:
            if p.dim() <= 1:
                d.zero_()
            else:
                flat_d, flat_p = d.reshape(p.shape[0], -1), p.detach().reshape(p.shape[0], -1)
                flat_d.mul_(flat_p.norm(dim=1, keepdim=True) / flat_d.norm(dim=1, keepdim=True).clamp_min(1e-12))
        direction.append(d)
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in direction))
    return [d / norm for d in direction]


@torch.no_grad()
def inverse_mean_valley(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    directions: int = 10,
    delta: float = 0.1,
    max_distance: float = 10.0,
    initial_distance: float | None = None,
    bisection_steps: int = 30,
    seed: int = 0,
    filter_normalized: bool = False,
) -> ValleyResult:
    """Measure MV and Inv. MV of ``model`` at its current parameters.

    Along each direction the loss is evaluated at geometrically growing distances (from
    ``initial_distance``, default ``max_distance / 1024``, doubling) until it exceeds
    L(x) + delta (or ``max_distance`` is reached), then the crossing is refined by
    ``bisection_steps`` bisections of that bracket. Directions are plain random unit vectors
    over the whole model by default (``filter_normalized=True`` for Li et al.'s filter
    normalisation). Runs in evaluation mode without gradient tracking; deterministic for a
    ``seed``; the model's parameters, and its training mode, are restored exactly afterwards.

    Args:
        model: the model (e.g. the DPPF consensus model).
        loss_fn: ``loss_fn(model(x), y)`` -> scalar mean loss.
        batches: (x, y) pairs, re-iterated for every evaluation (a list, not a generator).
        directions: K, the number of random directions.
        delta: the loss rise that defines the valley's edge.
        max_distance: the largest distance searched.
    """
    if isinstance(directions, bool) or not isinstance(directions, int) or directions < 1:
        raise ValueError(f"directions={directions!r} must be an int >= 1")
    if not delta > 0:
        raise ValueError(f"delta={delta} must be > 0")
    if not max_distance > 0:
        raise ValueError(f"max_distance={max_distance} must be > 0")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: the loss needs at least one (x, y) batch")
    initial = max_distance / 1024 if initial_distance is None else initial_distance
    if not 0 < initial <= max_distance:
        raise ValueError(f"initial_distance={initial} must be in (0, max_distance]")
    params = [p for p in model.parameters() if p.is_floating_point()]
    saved = [p.detach().clone() for p in params]
    was_training = model.training
    model.eval()

    def loss_at(direction: list[torch.Tensor], t: float) -> float:
        for p, p0, d in zip(params, saved, direction):
            p.copy_(p0).add_(d, alpha=t)
        total = sum(float(loss_fn(model(x), y)) for x, y in batches)
        return total / len(batches)

    try:
        base = loss_at([torch.zeros_like(p) for p in params], 0.0)
        threshold = base + delta
        gen = torch.Generator().manual_seed(seed)
        distances, capped = [], 0
        for _ in range(directions):
            direction = _random_direction(saved, gen, filter_normalized)
            lo, hi = 0.0, initial
            while hi < max_distance and loss_at(direction, hi) <= threshold:
                lo, hi = hi, min(2 * hi, max_distance)
            if loss_at(direction, hi) <= threshold:  # never exceeded within max_distance
                distances.append(max_distance)
                capped += 1
                continue
            for _ in range(bisection_steps):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if loss_at(direction, mid) <= threshold else (lo, mid)
            distances.append(hi)
    finally:
        for p, p0 in zip(params, saved):
            p.copy_(p0)
        model.train(was_training)
    mean_valley = sum(distances) / len(distances)
    return ValleyResult(
        mean_valley=mean_valley,
        inverse_mean_valley=1.0 / mean_valley,
        distances=distances,
        base_loss=base,
        capped=capped,
    )
