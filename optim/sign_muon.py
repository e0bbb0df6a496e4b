"""SignMuon: Muon's orthogonalised momentum, sent as one bit per entry and majority-voted.

Per worker i and matrix parameter W, each step (docs/design.md, "The math")::

    M_i <- beta*M_i + (1-beta)*(G_i + lambda_c*W)    local momentum (Nesterov optional)
    U_i <- NS(M_i)                                   the worker's Muon direction
    S   <- vote(sign(U_1), ..., sign(U_M))           one bit per entry on the wire
    D   <- NS(S) rescaled to entry-RMS 1             optional (polar_after_vote)
    W   <- W - lr*D - lr*lambda*W                    decoupled weight decay

Without the post-vote step D = S has entries in {-1, 0, +1}, so ``lr`` means the same in
both variants and is of the order of a sign or Adam learning rate. Parameters that are not
matrices take the Signum majority-vote path (or AdamW on a full-precision all-reduce).

:class:`SignMuon` is the sign-vote optimizer (:class:`~signmuon.optim.sign_vote.SignVoteOptimizer`)
with the matrix path's direction and post-vote step and the AdamW path added; where each half
runs (DDP hook, one process, ``vote_in_step``) is the base's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from signmuon.comm_hooks.dist import NonFiniteError

from .functional import LR_SCALINGS, adamw_update, orthogonalize, polar_direction
from .newton_schulz import MUON_COEFFICIENTS, NS_PRECISIONS
from .params import state_dtype
from .sign_vote import SignVoteOptimizer

__all__ = ["NON_MATRIX_PATHS", "NS_DTYPES", "SignMuon", "parameter_path"]

NON_MATRIX_PATHS = ("signum", "adamw")
NS_DTYPES = tuple(NS_PRECISIONS)


def parameter_path(param: torch.Tensor, use_muon: bool | None, non_matrix: str) -> str:
    """``"matrix"`` (NS + vote), ``"signum"`` (vote) or ``"adamw"`` (all-reduce) for ``param``.

    ``use_muon=None`` decides by shape: 2-D and conv kernels are matrices, the rest (biases,
    norm gains) are not. Embeddings and output heads are matrices too; route them with a
    param group ``{"params": [...], "use_muon": False}`` as Muon users usually do.
    """
    if use_muon is None:
        use_muon = param.dim() >= 2
    elif use_muon and param.dim() < 2:
        raise ValueError(f"use_muon=True asks for the matrix path, but the parameter is {param.dim()}-D")
    return "matrix" if use_muon else non_matrix


class SignMuon(SignVoteOptimizer):
    """SignMuon (Mishra, Trivedi, Kumar, arXiv 2605.16311) with optional post-vote polar step.

    Args:
        params: parameters or param groups; a group may set ``use_muon`` (None = by shape).
        lr: learning rate: each entry moves by about ``lr`` per step (entry-RMS of D <= 1).
            From ``torch.optim.Muon(lr=η)``: ``lr_from_muon(η)`` = η/5.
        momentum: beta of the local momentum, in [0, 1).
        nesterov: vote the Nesterov look-ahead ``G.lerp(M, beta)`` instead of ``M``.
        weight_decay: decoupled weight decay lambda (``W -= lr*lambda*W``).
        coupled_weight_decay: lambda_c added to the gradient before the momentum.
        ns_steps: Newton–Schulz iterations (see ``newton_schulz``).
        ns_coefficients: the quintic's coefficients (a, b, c).
        polar_after_vote: apply NS to the voted sign matrix and rescale it to entry-RMS 1.
        lr_scaling: the step size of each matrix (the voted D has entry-RMS 1): ``"global"``
            moves every entry by ``lr``; ``"fan_in"`` by ``lr / sqrt(fan_in)`` (the SignMuon
            reference's per-layer rule; fan_in = columns of the matrix view); ``"muon"`` by
            ``lr * MUON_UPDATE_RMS / sqrt(fan_in)``, the entry-RMS of ``torch.optim.Muon``'s
            update at the same ``lr`` (its default ``adjust_lr_fn``): the same step size for a
            Muon user's learning rate, though not the same quality (a sign step moves every
            entry by its full size; :func:`lr_from_muon` gives the global ``lr`` that keeps
            Muon's quality). Default ``"global"``, which trained best tuned (the sweeps are in
            ``benchmarks/results/``). Non-matrix parameters move by ``lr`` (or AdamW's step).
        ns_dtype: ``"float32"`` (default), ``"tfloat32"`` (float32 with TF32 matmuls, for the
            call) or ``"bfloat16"``, Newton–Schulz's compute precision. The faster two are
            faster on GPUs but flip more voted signs of low-rank momentum (see
            :func:`newton_schulz`; ``signmuon-bench ns-precision`` measures both).
        non_matrix: ``"signum"`` (vote the sign of the local momentum, one bit on the wire) or
            ``"adamw"`` (AdamW on the mean gradient, a full-precision all-reduce).
        adamw_lr: learning rate of the ``"adamw"`` path (None: ``lr``).
        adamw_betas: AdamW's betas on that path. (0.9, 0.95) as the auxiliary Adam of Keller
            Jordan's Muon and nanoGPT use, not torch's (0.9, 0.999): in the short, noisy runs
            Muon is used for, a second moment with a short memory follows the gradient scale
            of embeddings and heads as it changes. Pass (0.9, 0.999) for
            torch's. The path's weight decay is the group's ``weight_decay`` (0 by default).
        adamw_eps: AdamW's epsilon on that path.

    Keyword Args:
        vote (VoteConfig): as :class:`SignumMV`; a non-finite mean gradient on the AdamW path skips that
            parameter (counted in ``stats.skipped``) or raises, as ``nonfinite`` says.
        process_group (ProcessGroup): as :class:`SignumMV`.
        vote_in_step (bool): as :class:`SignumMV`.
        checkpoint_all_ranks (bool): as :class:`SignumMV`.
        master_weights (bool): as :class:`SignumMV`.
        exchange (Exchange): as :class:`SignumMV`.

    Under the DDP hook (or :meth:`register_backward_reducer`), ``step()`` applies the *sign* of
    what the vote left in ``.grad`` (and leaves that sign in ``.grad``), so gradient clipping or
    a GradScaler's unscaling (any positive rescaling of ``.grad`` between backward and
    ``step()``) changes nothing; a GradScaler must be given with :meth:`use_grad_scaler`.
    """

    whole_paths = ("matrix",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 2e-3,
        momentum: float = 0.95,
        *,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        coupled_weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
        polar_after_vote: bool = False,
        lr_scaling: str = "global",
        ns_dtype: str = "float32",
        non_matrix: str = "signum",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        **options: Any,
    ) -> None:
        self.ns_seconds = 0.0  # host seconds in Newton–Schulz, this rank (on a GPU: launch time only)
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            coupled_weight_decay=coupled_weight_decay, ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients),
            polar_after_vote=polar_after_vote, lr_scaling=lr_scaling, ns_dtype=ns_dtype, non_matrix=non_matrix,
            adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps, use_muon=None,
        )  # fmt: skip
        super().__init__(
            params,
            defaults,
            **options,  # vote, process_group, vote_in_step, checkpoint_all_ranks, master_weights
        )

    def check_group(self, group: dict[str, Any]) -> None:
        super().check_group(group)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ns_steps={steps!r} must be an int >= 1")
        if not group["coupled_weight_decay"] >= 0:
            raise ValueError(f"coupled_weight_decay={group['coupled_weight_decay']} must be >= 0")
        if group["lr_scaling"] not in LR_SCALINGS:
            raise ValueError(f"lr_scaling={group['lr_scaling']!r} must be one of {LR_SCALINGS}")
        if group["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"ns_dtype={group['ns_dtype']!r} must be one of {NS_DTYPES}")
        if group["non_matrix"] not in NON_MATRIX_PATHS:
            raise ValueError(f"non_matrix={group['non_matrix']!r} must be one of {NON_MATRIX_PATHS}")
        if group["adamw_lr"] is not None and not group["adamw_lr"] >= 0:
            raise ValueError(f"adamw_lr={group['adamw_lr']} must be >= 0")
        beta1, beta2 = group["adamw_betas"]
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"adamw_betas={group['adamw_betas']} must lie in [0, 1)")
        if not group["adamw_eps"] > 0:
            raise ValueError(f"adamw_eps={group['adamw_eps']} must be > 0")
        if group["use_muon"] not in (None, True, False):
            raise ValueError(f"use_muon={group['use_muon']!r} must be None (by shape), True or False")

    def path(self, group: dict[str, Any], param: torch.Tensor) -> str:
        path = parameter_path(param, group["use_muon"], group["non_matrix"])
        if path == "matrix" and param.numel() == 0:
            raise ValueError(
                "an empty matrix: Newton–Schulz has nothing to orthogonalise; "
                "leave it out of the optimizer or put it in a group with use_muon=False"
            )
        return path

    def init_state(self, state: dict[str, Any], param: torch.Tensor, path: str) -> None:
        if path != "adamw":
            return super().init_state(state, param, path)
        like = self.exchange.local_part(param)  # the parameter, or this rank's piece of it (ZeRO)
        state["exp_avg"] = torch.zeros_like(like, dtype=state_dtype(param), memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(like, dtype=state_dtype(param), memory_format=torch.preserve_format)
        state["step"] = torch.tensor(0.0)
        self.init_master(state, param)

    def _newton_schulz(self, group: dict[str, Any], fn, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        result = fn(tensor, group["ns_steps"], group["ns_coefficients"], group["ns_dtype"])
        self.ns_seconds += time.perf_counter() - start
        return result

    @torch.no_grad()
    def whole_direction(self, param: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """Newton–Schulz of the whole matrix's direction (:func:`~signmuon.optim.functional.orthogonalize`)
        on the matrix path; only the signs of the result matter."""
        group, path = self.route(param)
        if path != "matrix":
            return direction
        return self._newton_schulz(group, orthogonalize, direction)

    def finish_vote(self, group: dict[str, Any], param: torch.Tensor, voted: torch.Tensor, path: str) -> torch.Tensor:
        """D from the voted signs S: S itself, or NS(S) rescaled to entry-RMS 1 (``polar_after_vote``)."""
        if not self.finishes(group, path):
            return voted
        return self._newton_schulz(group, polar_direction, voted)

    def apply_mean(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, nonfinite: bool) -> None:
        """AdamW on the all-reduced mean gradient; a non-finite mean skips the parameter."""
        if nonfinite:  # the mean gradient's: the same on every rank
            if self.vote_config.nonfinite == "raise":
                raise NonFiniteError(
                    f"NaN or Inf in the averaged gradient of a parameter of shape {tuple(param.shape)}"
                )
            self.stats.skipped += 1
            return
        state = self.state[param]
        state["step"] += 1
        adamw_update(
            self.update_target(param),
            grad.to(state["exp_avg"].dtype),
            state["exp_avg"],
            state["exp_avg_sq"],
            state["step"].item(),
            lr=group["lr"] if group["adamw_lr"] is None else group["adamw_lr"],
            betas=group["adamw_betas"],
            eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )
