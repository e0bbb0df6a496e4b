"""Signum-MV and signSGD-MV: the sign-vote optimizer as it is, with its defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .sign_vote import SignVoteOptimizer

__all__ = ["SignSGDMV", "SignumMV"]


class SignumMV(SignVoteOptimizer):
    """Signum with majority vote (Bernstein et al., ICLR 2019): ``m <- beta*m + (1-beta)*g`` on
    each worker, ``W <- W - lr*vote(sign(m)) - lr*lambda*W``.

    Under DDP the plain ``sign_vote_hook`` + ``torch.optim.SGD`` does the same with per-bucket
    momentum; this class serves where the optimizer must own the momentum (DeepSpeed,
    ``vote_in_step``) and where ``.grad`` may be rescaled after the vote (clipping, a
    GradScaler's unscaling, given by :meth:`use_grad_scaler`: ``step()`` takes the sign of what
    the vote left).

    Args:
        params: parameters or param groups.
        lr: each entry moves by ``lr`` per step (or 0 where the vote is 0).
        momentum: beta in [0, 1); 0 is signSGD-MV.
        weight_decay: decoupled weight decay lambda (``W -= lr*lambda*W``).

    Keyword Args:
        vote (VoteConfig): the vote's settings (:class:`~signmuon.comm_hooks.VoteConfig`: tie mode, seed,
            algorithm, kernels, ``hierarchical``, and ``nonfinite``: if any rank's gradient
            holds NaN or Inf, ``"skip"`` moves no voted entry that step (under the DDP hook too,
            whichever bucket held it), counted in ``stats.skipped``, the rank with the bad
            gradient keeping its momentum; ``"raise"`` raises on every rank). Also used by the
            DDP hook.
        process_group (ProcessGroup): ranks that vote (None = WORLD).
        vote_in_step (bool): let ``step()`` vote across ``process_group`` itself (no DDP hook).
        checkpoint_all_ranks (bool): make ``state_dict()`` a collective that gathers every rank's
            local momentum into the one dict (so a checkpoint written by rank 0 alone, as
            DeepSpeed writes it, resumes every rank exactly; ``load_state_dict`` picks this
            rank's part). Off by default: then each rank saves its own ``state_dict()``.
        master_weights (bool): keep a float32 copy of every 16-bit (bf16, fp16) parameter in the state;
            updates go to it and the parameter becomes its rounded copy, so steps smaller than
            the parameter's 16-bit spacing add up. Momentum is float32 for 16-bit parameters
            either way.
        exchange (Exchange): vote through it from the start, not in ``step()``: an integration's
            (DeepSpeed ZeRO's partitions), which also says where each parameter's state lives.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.9,
        *,
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(
            params,
            dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
            **options,  # vote, process_group, vote_in_step, checkpoint_all_ranks, master_weights, exchange
        )

    def check_group(self, group: dict[str, Any]) -> None:
        if group.get("use_muon") or group.get("non_matrix", "signum") != "signum":
            raise ValueError(f"{type(self).__name__} votes the sign of every parameter; use SignMuon for other paths")
        super().check_group(group)


class SignSGDMV(SignumMV):
    """signSGD with majority vote: Signum without momentum (each worker votes sign(g)).
    Arguments as :class:`SignumMV`, without ``momentum``."""

    fixed_settings = ("momentum", *SignumMV.fixed_settings)

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3, **options: Any
    ) -> None:
        if "momentum" in options:
            raise TypeError("SignSGDMV has no momentum: it is SignumMV with momentum=0")
        super().__init__(params, lr, 0.0, **options)
