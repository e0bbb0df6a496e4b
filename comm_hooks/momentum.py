"""Signum's momentum step on its own, per parameter (the sign-vote optimizers). The DDP hook
advances its buckets' momentum (flat: the whole bucket; node-aware: this rank's slice of the
node mean) inside the pack instead (``vote.MomentumStep``, the kernels' ``momentum_pack``);
both round as :func:`~signmuon.comm_hooks.kernels.layout.lerp_unless` does."""

from __future__ import annotations

import torch

from .dist import nonfinite_flag
from .kernels.layout import lerp_unless

__all__ = ["advance_momentum"]


def advance_momentum(buf: torch.Tensor, grad: torch.Tensor, beta: float) -> torch.Tensor:
    """``buf <- beta*buf + (1-beta)*grad`` (as ``buf.lerp_(grad, 1-beta)``, torch's Muon form)
    unless ``grad`` holds NaN or Inf; returns that flag (0-d bool).

    A non-finite gradient never enters the momentum; the flag goes into the vote's header so
    every rank skips the bucket. On CPU the check is one summing pass; on a GPU the update is a
    select on the device (no host synchronisation).
    """
    bad = nonfinite_flag(grad)
    lerp_unless(buf, grad, 1.0 - beta, bad)
    return bad
