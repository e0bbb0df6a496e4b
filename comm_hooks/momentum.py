"""Signum's momentum, the one implementation every path shares (the DDP hook per bucket, the
node-aware vote on node means, the sign-vote optimizers per parameter)."""

from __future__ import annotations

import torch

from .dist import nonfinite_flag
from .kernels.layout import lerp_unless

__all__ = ["advance_momentum"]


def advance_momentum(buf: torch.Tensor, grad: torch.Tensor, beta: float, nonfinite: torch.Tensor | None = None) -> torch.Tensor:
    """``buf <- beta*buf + (1-beta)*grad`` (as ``buf.lerp_(grad, 1-beta)``, torch's Muon form)
    unless ``grad`` holds NaN or Inf; returns that flag (0-d bool). A given ``nonfinite`` flag
    decides instead (the node-aware vote passes its whole node mean's, of which ``grad`` is
    this rank's slice, so that every rank of the node skips alike).

    A non-finite gradient never enters the momentum; the flag goes into the vote's header so
    every rank skips the bucket. On CPU the check is one summing pass; on a GPU the update is a
    select on the device (no host synchronisation).
    """
    bad = nonfinite_flag(grad) if nonfinite is None else nonfinite
    lerp_unless(buf, grad, 1.0 - beta, bad)
    return bad
