"""Training under ``torch.amp.GradScaler``: what a sign-vote optimizer needs to know of the
scaler, and what the scaler must learn from the vote (docs/usage.md, "GradScaler").

The scaler multiplies the loss by its scale S before backward; before ``step()`` it divides the
gradients by S and looks for NaN or Inf, and where it finds some it skips ``step()`` and backs S
off. Two parts of the vote run before that check, so the optimizer must be given the scaler
(``opt.use_grad_scaler(scaler)``; Lightning's ``SignDDPStrategy`` and Accelerate's
``register_comm_hook`` do it):

* Under the DDP hook each worker's momentum advances during backward, from gradients still
  scaled by S: the hook divides them by S first (else a scale that changes mixes scales in the
  momentum), and a vote skipped for NaN or Inf hands DDP NaN instead of zeros, so that every
  rank's scaler finds it, skips the step and backs off alike.
* With ``vote_in_step`` nothing is reduced before the scaler looks: one rank's overflow would
  skip ``step()`` on that rank alone while the others wait for it in the vote. The scaler's
  ``unscale_`` first agrees across the ranks whether any gradient holds NaN or Inf (one
  all-reduce of one word), and where one does every rank's scaler finds it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["GradScalerSupport", "agree_before_unscale"]


class GradScalerSupport:
    """The optimizer's side (a base of :class:`~signmuon.optim.SignVoteOptimizer`)."""

    grad_scaler: Any = None
    """The ``torch.amp.GradScaler`` given to :meth:`use_grad_scaler` (None: none)."""

    def use_grad_scaler(self, scaler: Any) -> None:
        """Train under ``scaler`` (a ``torch.amp.GradScaler``), before the first backward.

        The DDP hook then votes the unscaled gradients' directions and hands a skipped vote on as
        NaN, so the scaler skips that step and backs off on every rank; with ``vote_in_step`` the
        scaler's check is agreed across the ranks first. A step the scaler skips moves no
        parameter; under the hook each worker's momentum has already taken in its own finite
        gradients of that step (with ``vote_in_step``, nothing has moved)."""
        if not all(callable(getattr(scaler, name, None)) for name in ("get_scale", "unscale_", "is_enabled")):
            raise TypeError(f"use_grad_scaler takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.exchange.use_grad_scaler(self, scaler)
        agree_before_unscale(scaler, self)
        self.grad_scaler = scaler

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by ``GradScaler.step()`` (and Lightning's precision plugin): False, the scaler
        unscales and skips as for any optimizer. Read by a GradScaler's ``step()`` where the vote
        needs the scaler and none was given, it raises (on every rank: each steps its optimizer
        through its scaler) instead of letting the scaler train on overflows it never sees."""
        caller = sys._getframe(1).f_locals.get("self")  # getattr() itself adds no frame
        if (
            isinstance(caller, torch.amp.GradScaler)
            and self.grad_scaler is None
            and self.exchange.needs_grad_scaler(self)
        ):
            name = type(self).__name__
            raise RuntimeError(
                f"a GradScaler steps this {name}, which was not given it: call opt.use_grad_scaler(scaler) before "
                "the first backward, so that the vote divides the gradients by the loss scale before the momentum "
                "and every rank's scaler learns of a NaN or Inf on any rank"
            )
        return False


def agree_before_unscale(scaler: Any, optimizer: Any) -> None:
    """Make ``scaler.unscale_(optimizer)`` (also called by ``scaler.step``) first run the
    exchange's ``before_unscale`` (``vote_in_step``: agree on NaN or Inf across the ranks).
    Installed once per (scaler, optimizer)."""
    unscale = scaler.unscale_
    if optimizer in getattr(unscale, "signmuon_optimizers", ()):
        return

    def unscale_(opt: Any) -> None:
        if opt is optimizer:
            optimizer.exchange.before_unscale(optimizer)
        return unscale(opt)

    unscale_.signmuon_optimizers = (*getattr(unscale, "signmuon_optimizers", ()), optimizer)
    scaler.unscale_ = unscale_
