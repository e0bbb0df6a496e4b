"""The optimisation math as small pure functions, in the shape of Muon's ``muon_update``.

Each takes tensors and settings and returns a direction (advancing a momentum buffer in place
where it has one); nothing here communicates or keeps state. The optimizers call them from
the methods docs/design.md lists under "A new optimizer", on whole parameters or on any tensor
the math allows (a shard of a Signum-voted tensor, a whole matrix gathered for Newton–Schulz).

Per worker, before the vote (docs/design.md, "The math")::

    M <- beta*M + (1-beta)*(G + lambda_c*W)     signum_direction: M (or G.lerp(M, beta), Nesterov)
    U <- NS(M)                                  muon_direction: orthogonalize(signum_direction(...))

After the vote S of the signs: ``polar_direction(S)`` (optional, NS(S) at entry-RMS 1), then
``W <- W - step*D - lr*lambda*W``. Parameters on full-precision means take ``adamw_update``.
"""

from __future__ import annotations

import math

import torch

from signmuon.comm_hooks.dist import nonfinite_flag
from signmuon.comm_hooks.kernels.bits import advance_momentum_unless

from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz

__all__ = [
    "LR_SCALINGS",
    "MUON_LR_RATIO",
    "MUON_UPDATE_RMS",
    "adamw_update",
    "advance_momentum",
    "lr_from_muon",
    "muon_direction",
    "orthogonalize",
    "polar_direction",
    "signum_direction",
    "step_size",
]

LR_SCALINGS = ("global", "fan_in", "muon")
# Entry-RMS of torch.optim.Muon's update times sqrt(fan_in) at its default adjust_lr_fn, for
# full-rank momentum (the NS output's singular values sit in a band around 1).
MUON_UPDATE_RMS = 0.9
# SignMuon's lr (lr_scaling="global") per unit of a torch.optim.Muon user's lr: see lr_from_muon.
MUON_LR_RATIO = 0.2


def advance_momentum(buf: torch.Tensor, grad: torch.Tensor, beta: float) -> torch.Tensor:
    """``buf <- beta*buf + (1-beta)*grad`` (as ``buf.lerp_(grad, 1-beta)``, torch's Muon form)
    unless ``grad`` holds NaN or Inf; returns that flag (0-d bool).

    Signum's momentum step per parameter (the optimizers'); the DDP hook advances its buckets'
    momentum inside the pack instead (``vote.MomentumStep``, the kernels' ``momentum_pack``),
    rounding alike (:func:`~signmuon.comm_hooks.kernels.bits.advance_momentum_unless`). A non-finite
    gradient never enters the momentum. On CPU the check is one summing pass; on a GPU the
    update is a select on the device (no host synchronisation).
    """
    bad = nonfinite_flag(grad)
    advance_momentum_unless(buf, grad, 1.0 - beta, bad)
    return bad


def signum_direction(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: float,
    *,
    nesterov: bool = False,
    param: torch.Tensor | None = None,
    coupled_weight_decay: float = 0.0,
    present: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advance ``momentum`` with ``grad`` (plus ``coupled_weight_decay * param``) and return the
    direction whose signs are voted: the momentum, or its Nesterov look-ahead ``G.lerp(M, beta)``.

    ``present`` (0-d bool): whether this worker has a gradient at all. Where it is not set the
    worker abstains: the momentum stays put and the direction is zero (it votes 0), as a rank
    without a gradient must (DDP hands such a rank zeros, under ``Join`` or for an unused
    parameter, instead of nothing).

    ``beta == 0`` is signSGD: the gradient itself, no momentum kept. A gradient holding NaN or
    Inf never enters the momentum, and the direction keeps them (the look-ahead carries the
    gradient's NaN and Inf; without Nesterov the gradient itself is returned): the vote sees
    the non-finite entries and every rank skips (or raises on) the tensor. Off the CPU neither
    form reads the flag on the host (the plain momentum is selected against the gradient on the
    device), so on a GPU it runs without synchronising.
    """
    if coupled_weight_decay:
        grad = grad.add(param, alpha=coupled_weight_decay)
    if beta == 0:
        return grad  # an absent gradient is zero: it votes 0 and there is no momentum to keep
    bad = nonfinite_flag(grad)
    if momentum.device.type == "cpu":  # a branch on both flags, read at once
        is_bad, has = (bool(bad), True) if present is None else torch.stack([bad, present]).tolist()
        if not has:
            return torch.zeros_like(momentum)
        if not is_bad:  # a non-finite gradient never enters the momentum
            momentum.lerp_(grad.to(momentum.dtype), 1.0 - beta)
        if nesterov:
            return grad.to(momentum.dtype).lerp(momentum, beta)
        return grad if is_bad else momentum
    # On a device, selects (no host read).
    advance_momentum_unless(momentum, grad, 1.0 - beta, bad if present is None else bad | ~present)
    if nesterov:
        direction = grad.to(momentum.dtype).lerp(momentum, beta)
    else:
        direction = torch.where(bad, grad.to(momentum.dtype), momentum)
    return direction if present is None else torch.where(present, direction, 0.0)


def orthogonalize(
    direction: torch.Tensor,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    ns_dtype: torch.dtype | str = torch.float32,
) -> torch.Tensor:
    """Newton–Schulz on the matrix view of ``direction`` (conv kernels as (out, in·kh·kw)),
    shaped back like ``direction``."""
    return newton_schulz(as_matrix(direction), ns_steps, ns_coefficients, dtype=ns_dtype).view_as(direction)


def muon_direction(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: float,
    *,
    nesterov: bool = True,
    ns: tuple[int, tuple[float, float, float], torch.dtype | str] = (5, MUON_COEFFICIENTS, torch.float32),
    **signum_options,
) -> torch.Tensor:
    """A worker's Muon direction: :func:`orthogonalize` (``ns``: its steps, coefficients and
    dtype) of :func:`signum_direction` (``param`` and ``coupled_weight_decay`` go there). It
    needs the whole matrix, not a shard."""
    return orthogonalize(signum_direction(grad, momentum, beta, nesterov=nesterov, **signum_options), *ns)


def polar_direction(voted: torch.Tensor, *ns_settings) -> torch.Tensor:
    """The post-vote polar step: NS of the voted sign matrix (``ns_settings``: those of
    :func:`orthogonalize` after the tensor), rescaled to entry-RMS 1 (an all-zero vote stays
    zero), so the learning rate means what it means without it."""
    polar = orthogonalize(voted, *ns_settings)
    rms = polar.norm() / math.sqrt(polar.numel())
    return polar.div_(rms.clamp_min(1e-12))


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on ``param`` in place (``step`` counts from 1), torch's bias correction."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.mul_(1 - lr * weight_decay)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def step_size(lr: float, lr_scaling: str, param: torch.Tensor) -> float:
    """How far each entry of a matrix parameter moves per unit of the voted direction:
    ``"global"``: ``lr``; ``"fan_in"``: ``lr / sqrt(fan_in)``; ``"muon"``:
    ``lr * MUON_UPDATE_RMS / sqrt(fan_in)`` (fan_in: columns of the matrix view)."""
    if lr_scaling == "global":
        return lr
    fan_in = as_matrix(param).shape[1]
    scale = 1.0 if lr_scaling == "fan_in" else MUON_UPDATE_RMS
    return lr * scale / math.sqrt(fan_in)


def lr_from_muon(muon_lr: float) -> float:
    """SignMuon's ``lr`` (``lr_scaling="global"``) for a user of ``torch.optim.Muon(lr=muon_lr)``:
    ``muon_lr * MUON_LR_RATIO`` (= ``muon_lr / 5``), for the matrices and the Signum-voted rest alike.

    Why a measured ratio and not the same step size (``lr_scaling="muon"``): a sign step moves
    every entry by its full size, and the step that trains best is several times Muon's update
    RMS. The ratio comes from learning-rate sweeps of both optimizers on the same task; the
    figures are in ``benchmarks/results/`` and docs/design.md. A starting point that needs no
    sweep; a sweep of ×0.5..×2 around it is still worth its cost.
    """
    if not (muon_lr > 0 and math.isfinite(muon_lr)):
        raise ValueError(f"muon_lr={muon_lr} must be a positive, finite learning rate")
    return muon_lr * MUON_LR_RATIO
