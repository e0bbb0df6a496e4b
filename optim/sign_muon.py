"""SignMuon: Muon's orthogonalised momentum, sent as one bit per entry and majority-voted.

Per worker i and matrix parameter W, each step (docs/design.md, §1)::

    M_i <- beta*M_i + (1-beta)*(G_i + lambda_c*W)    local momentum (Nesterov optional)
    U_i <- NS(M_i)                                   the worker's Muon direction
    S   <- vote(sign(U_1), ..., sign(U_M))           one bit per entry on the wire
    D   <- NS(S) rescaled to entry-RMS 1             optional (polar_after_vote)
    W   <- W - lr*D - lr*lambda*W                    decoupled weight decay

Without the post-vote step D = S has entries in {-1, 0, +1}, so ``lr`` means the same in
both variants and is of the order of a sign or Adam learning rate. Parameters that are not
matrices take the Signum majority-vote path (or AdamW on a full-precision all-reduce).

Where the pre-vote half runs:

* under DDP, in :func:`signmuon.comm_hooks.sign_muon_hook`, on each worker's local gradient
  and overlapped with backward: ``opt.register_comm_hook(ddp_model)``; ``step()`` then does
  the post-vote half;
* on one process, all of it in ``step()``;
* with ``vote_in_step=True``, ``step()`` votes across ``process_group`` itself (for data
  parallelism without DDP hooks, e.g. an engine whose own gradient all-reduce is off).

On several ranks without either, ``step()`` raises rather than silently applying the wrong math.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks import (
    BackwardReducer,
    CommStats,
    NonFiniteError,
    SignMuonHookState,
    SignSegments,
    VoteConfig,
    VoteMismatchError,
    allreduce_mean,
    check_same_settings,
    gather_rows,
    group_size_rank,
    majority_vote,
    NodeLayout,
    matrix_cost,
    node_layout,
    nonfinite_flag,
    owners,
    sign_muon_hook,
    vote_owned,
    world_mean,
)

from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz

__all__ = ["LR_SCALINGS", "MUON_LR_RATIO", "MUON_UPDATE_RMS", "NS_DTYPES", "SignMuon", "lr_from_muon", "parameter_path",
           "step_size"]  # fmt: skip


def _to_cpu(state: dict) -> dict:
    return {k: {name: v.detach().cpu() if torch.is_tensor(v) else v for name, v in s.items()} for k, s in state.items()}

NON_MATRIX_PATHS = ("signum", "adamw")
LR_SCALINGS = ("global", "fan_in", "muon")
NS_DTYPES = ("float32", "bfloat16")
# Entry-RMS of torch.optim.Muon's update times sqrt(fan_in), at its default adjust_lr_fn, for
# full-rank momentum: the NS output's singular values sit in the band around 1 (measured
# 0.88 for 64x64, 0.94 for 768x3072 and 3072x768; benchmarks/results/ has the figures).
MUON_UPDATE_RMS = 0.9


# SignMuon's lr (lr_scaling="global") per unit of a torch.optim.Muon user's lr, by measurement:
# see lr_from_muon.
MUON_LR_RATIO = 0.2


def lr_from_muon(muon_lr: float) -> float:
    """SignMuon's ``lr`` (``lr_scaling="global"``) for a user of ``torch.optim.Muon(lr=muon_lr)``:
    ``muon_lr / 5`` (:data:`MUON_LR_RATIO`), for the matrices and the Signum-voted rest alike.

    Why a measured ratio and not the same step size (``lr_scaling="muon"``): a sign step moves
    every entry by its full size, and the step that trains best is several times Muon's update
    RMS (a Muon user's lr kept that way ended 5% behind Muon on charlm). On charlm (4 ranks, 300
    steps, 3 seeds per point, seeds 0-2 and 3-5), SignMuon at ``muon_lr / 5`` ended within 1% of
    Muon+AdamW at ``muon_lr`` for every ``muon_lr`` tried from 0.01 to 0.08, below it for
    0.01..0.04 (e.g. 0.02: 1.891 ± 0.024 vs 1.973 ± 0.011 and 1.880 ± 0.033 vs 1.951 ± 0.027).
    ``/ 10`` was 1-2% behind at 0.015 and 0.02. On digits (a small CNN) the best ratio was 1/10:
    ``/ 5`` kept accuracy within a point of Muon's at 3 of 4 learning rates. A starting point
    that needs no sweep, then; a sweep of ×0.5..×2 around it is still worth its cost.
    """
    if not (muon_lr > 0 and math.isfinite(muon_lr)):
        raise ValueError(f"muon_lr={muon_lr} must be a positive, finite learning rate")
    return muon_lr * MUON_LR_RATIO


def step_size(lr: float, lr_scaling: str, param: torch.Tensor) -> float:
    """How far each entry of a matrix parameter moves per unit of the voted direction."""
    if lr_scaling == "global":
        return lr
    fan_in = as_matrix(param).shape[1]
    scale = 1.0 if lr_scaling == "fan_in" else MUON_UPDATE_RMS
    return lr * scale / math.sqrt(fan_in)


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


def _check_group(group: dict[str, Any]) -> None:
    if not group["lr"] >= 0:
        raise ValueError(f"lr={group['lr']} must be >= 0")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum={group['momentum']} must be in [0, 1)")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps={steps!r} must be an int >= 1")
    for name in ("weight_decay", "coupled_weight_decay"):
        if not group[name] >= 0:
            raise ValueError(f"{name}={group[name]} must be >= 0")
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


class SignMuon(torch.optim.Optimizer):
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
            entry by its full size; on charlm Muon's lr kept this way ended 5% behind Muon;
            :func:`lr_from_muon` gives the global ``lr`` that kept Muon's quality).
            Default ``"global"``: tuned, it beat ``"fan_in"`` on charlm (1.889 vs 2.052 final
            loss, 3 seeds) and matched Muon. Non-matrix parameters move by ``lr`` (or AdamW's step).
        ns_dtype: ``"float32"`` (default) or ``"bfloat16"``, Newton–Schulz's compute dtype.
            bfloat16 is faster on GPUs but flips 5–9% of the voted signs of low-rank momentum
            (see :func:`newton_schulz`).
        non_matrix: ``"signum"`` (vote the sign of the local momentum, one bit on the wire) or
            ``"adamw"`` (AdamW on the mean gradient, a full-precision all-reduce).
        adamw_lr: learning rate of the ``"adamw"`` path (None: ``lr``).
        adamw_betas: AdamW's betas on that path. (0.9, 0.95) as the auxiliary Adam of Keller
            Jordan's Muon and nanoGPT use, not torch's (0.9, 0.999): in the short, noisy runs
            Muon is used for, a second moment that forgets in ~20 steps instead of ~1000 follows
            the gradient scale of embeddings and heads as it changes. Pass (0.9, 0.999) for
            torch's. The path's weight decay is the group's ``weight_decay`` (0 by default).
        adamw_eps: AdamW's epsilon on that path.
        vote: the vote's settings (:class:`~signmuon.comm_hooks.VoteConfig`: tie mode, seed,
            algorithm, kernels, and ``nonfinite``: if any rank's gradient holds NaN or Inf,
            ``"skip"`` moves no voted entry that step and no AdamW parameter whose mean gradient
            is non-finite, counted in ``stats.skipped``, the rank with the bad gradient keeping
            its momentum; ``"raise"`` raises on every rank). Also used by the DDP hook.
        process_group: ranks that vote (None = WORLD).
        vote_in_step: let ``step()`` vote across ``process_group`` itself (no DDP hook).
        checkpoint_all_ranks: make ``state_dict()`` a collective that gathers every rank's
            local momentum into the one dict (so a checkpoint written by rank 0 alone, as
            DeepSpeed writes it, resumes every rank exactly; ``load_state_dict`` picks this
            rank's part). Off by default: then each rank saves its own ``state_dict()``.

    Under the DDP hook (or :meth:`register_backward_reducer`), ``step()`` applies the *sign* of
    what the vote left in ``.grad`` (and leaves that sign in ``.grad``), so gradient clipping,
    GradScaler unscaling or averaging over accumulated micro-batches (any positive rescaling of
    ``.grad`` between backward and ``step()``) changes nothing.
    """

    _default_use_muon: bool | None = None  # param groups' default: None decides by shape

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
        vote: VoteConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        vote_in_step: bool = False,
        checkpoint_all_ranks: bool = False,
    ) -> None:
        vote = VoteConfig() if vote is None else vote
        if not isinstance(vote, VoteConfig):
            raise TypeError(f"vote must be a VoteConfig, got {type(vote).__name__}")
        self.vote_config = vote
        self.process_group = process_group
        self.vote_in_step = bool(vote_in_step)
        self.checkpoint_all_ranks = bool(checkpoint_all_ranks)
        self.steps_taken = 0  # optimizer steps so far (tie-break seeds; checkpointed)
        self.stats = CommStats()  # bytes step() sends itself (vote_in_step); the hook has its own
        self.ns_seconds = 0.0  # host seconds in Newton–Schulz, this rank (on a GPU: launch time only)
        self._comm_state: SignMuonHookState | None = None
        self._hook_iter_seen = 0
        self._hook_raised_seen = 0
        self._settings_checked = False  # vote_in_step: compared across ranks at the first step
        self._paths: dict[torch.Tensor, tuple[int, str]] = {}  # param -> (group index, path)
        self._layout: NodeLayout | None = None  # vote_in_step, hierarchical: made at the first step
        self._owners: tuple[int, dict[torch.Tensor, int]] | None = None  # (L, param -> owning local rank)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            coupled_weight_decay=coupled_weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            polar_after_vote=polar_after_vote,
            lr_scaling=lr_scaling,
            ns_dtype=ns_dtype,
            non_matrix=non_matrix,
            adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            use_muon=self._default_use_muon,
        )
        super().__init__(params, defaults)

    # -- parameter routing and eager state ------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group)
        self._settings_checked = False  # the new shapes are compared at the next step
        self._owners = None  # ownership is recomputed with the new parameters
        names = group.get("param_names") or [None] * len(group["params"])
        for index, (p, name) in enumerate(zip(group["params"], names)):
            label = name or f"parameter {index} of group {len(self.param_groups) - 1} (shape {tuple(p.shape)})"
            try:
                path = parameter_path(p, group["use_muon"], group["non_matrix"])
            except ValueError as error:
                raise ValueError(f"{label}: {error}") from None
            if p.layout != torch.strided:
                raise ValueError(f"{label} is a {p.layout} tensor; {type(self).__name__} needs dense parameters")
            if path == "matrix" and p.numel() == 0:
                raise ValueError(
                    f"{label} is an empty matrix: Newton–Schulz has nothing to orthogonalise; "
                    "leave it out of the optimizer or put it in a group with use_muon=False"
                )
            self._paths[p] = (len(self.param_groups) - 1, path)
            # Eager, rank-symmetric state: the same keys and shapes everywhere from step 0.
            state = self.state[p]
            if path == "adamw":
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0)
            else:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _route(self, param: torch.Tensor) -> tuple[dict[str, Any], str]:
        """(param group, path) of ``param``."""
        if param not in self._paths:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not managed by this SignMuon")
        index, path = self._paths[param]
        return self.param_groups[index], path

    def votes(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s update is voted (matrix and Signum paths) or all-reduced (AdamW)."""
        return self._route(param)[1] != "adamw"

    # -- the two halves of the math --------------------------------------------------------

    @torch.no_grad()
    def local_direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Pre-vote half on this worker: advance the momentum with ``grad``, return the direction.

        Matrix path: NS of the (Nesterov) momentum; Signum path: the momentum itself. Only the
        signs of the result matter to the vote.
        """
        group, path = self._route(param)
        if bool(nonfinite_flag(grad)):
            return grad  # voted as is: its NaN/Inf flag makes every rank skip; momentum untouched
        beta = group["momentum"]
        buf = self.state[param]["momentum_buffer"]
        if group["coupled_weight_decay"]:
            grad = grad.add(param, alpha=group["coupled_weight_decay"])
        if beta == 0 and path != "matrix":
            return grad  # signSGD: the gradient is the direction (no momentum to keep)
        buf.lerp_(grad, 1 - beta)
        direction = grad.lerp(buf, beta) if group["nesterov"] else buf
        if path == "matrix":
            start = time.perf_counter()
            matrix = newton_schulz(
                as_matrix(direction), group["ns_steps"], group["ns_coefficients"], dtype=getattr(torch, group["ns_dtype"])
            )
            self.ns_seconds += time.perf_counter() - start
            return matrix.view_as(param)
        return direction

    def _post_vote(self, group: dict[str, Any], voted: torch.Tensor, path: str) -> torch.Tensor:
        """D from the voted signs S: S itself, or NS(S) rescaled to entry-RMS 1."""
        if path != "matrix" or not group["polar_after_vote"]:
            return voted
        start = time.perf_counter()
        polar = newton_schulz(
            as_matrix(voted), group["ns_steps"], group["ns_coefficients"], dtype=getattr(torch, group["ns_dtype"])
        )
        self.ns_seconds += time.perf_counter() - start
        rms = polar.norm() / math.sqrt(polar.numel())
        return polar.div_(rms.clamp_min(1e-12)).view_as(voted)  # all-zero S stays zero

    def _adamw_update(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        if bool(nonfinite_flag(grad)):  # the mean gradient: the same on every rank
            if self.vote_config.nonfinite == "raise":
                raise NonFiniteError(f"NaN or Inf in the averaged gradient of a parameter of shape {tuple(param.shape)}")
            self.stats.skipped += 1
            return
        lr = group["lr"] if group["adamw_lr"] is None else group["adamw_lr"]
        beta1, beta2 = group["adamw_betas"]
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["adamw_eps"])
        param.mul_(1 - lr * group["weight_decay"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))

    def settings(self) -> dict[str, Any]:
        """What must be equal on every rank: hyperparameters and parameter shapes."""
        groups = [
            {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "shapes": [tuple(p.shape) for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"optimizer": type(self).__name__, "vote": self.vote_config.settings(),
                "vote_in_step": self.vote_in_step, "checkpoint_all_ranks": self.checkpoint_all_ranks,
                "groups": groups}  # fmt: skip

    # -- DDP hook --------------------------------------------------------------------------

    @property
    def comm_state(self) -> SignMuonHookState:
        """The hook state; asking for it tells ``step()`` that the hook does the pre-vote half."""
        if self._comm_state is None:
            self._comm_state = SignMuonHookState(self, self.process_group, vote=self.vote_config)
            self._comm_state.iter = self._hook_iter_seen = self.steps_taken
            self._hook_raised_seen = 0
        return self._comm_state

    @property
    def has_comm_hook(self) -> bool:
        """Whether a hook (DDP's or :meth:`register_backward_reducer`'s) does the pre-vote half."""
        return self._comm_state is not None

    def register_comm_hook(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> SignMuonHookState:
        """``ddp_model.register_comm_hook(self.comm_state, sign_muon_hook)``; returns the state."""
        ddp_model.register_comm_hook(self.comm_state, sign_muon_hook)
        return self.comm_state

    def register_backward_reducer(
        self, *, sync: Callable[[], bool] | None = None, bucket_cap_mb: float = 25.0
    ) -> BackwardReducer:
        """Without DDP: run :func:`sign_muon_hook` on buckets as backward produces them.

        What DDP does with the hook, for loops without DDP (a DeepSpeed engine, a hand-written
        loop): after ``loss.backward()`` the gradients hold the vote and ``step()`` applies it.
        ``sync`` says whether this backward ends a gradient-accumulation window (see
        :class:`~signmuon.comm_hooks.BackwardReducer`). Set ``process_group`` before calling.
        """
        if self.vote_in_step:
            raise ValueError("register_backward_reducer() votes in backward; create the optimizer with vote_in_step=False")
        params = [p for group in self.param_groups for p in group["params"]]
        return BackwardReducer(params, self.comm_state, sign_muon_hook, sync=sync, bucket_cap_mb=bucket_cap_mb)

    def _check_hook_ran(self) -> None:
        # Backward passes that raised NonFiniteError (caught by the user) left zero gradients.
        raised = self._comm_state.raised - self._hook_raised_seen
        ran = self._comm_state.iter - self._hook_iter_seen - raised
        if ran == 0 and raised:
            ran = 1  # a step on the zeroed gradients of a failed backward moves nothing voted
        if ran == 0:
            raise RuntimeError(
                "SignMuon.step(): sign_muon_hook has not run since the last step; call backward() "
                "through the DDP model the hook is registered on before step()"
            )
        if ran > 1:
            raise RuntimeError(
                f"SignMuon.step(): sign_muon_hook ran {ran} times since the last step, advancing the "
                "momentum each time; accumulate micro-batches with their forward and backward under "
                "ddp_model.no_sync()"
            )
        self._hook_iter_seen = self._comm_state.iter
        self._hook_raised_seen = self._comm_state.raised

    # -- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world_size, _ = group_size_rank(self.process_group)
        hook_mode = self._comm_state is not None
        if hook_mode:
            self._check_hook_ran()
        elif world_size > 1 and not self.vote_in_step:
            raise RuntimeError(
                f"SignMuon on {world_size} ranks without its communication hook: under DDP call "
                "opt.register_comm_hook(ddp_model); without DDP pass vote_in_step=True"
            )
        elif world_size > 1 and not self._settings_checked:
            device = self.param_groups[0]["params"][0].device
            check_same_settings(self.settings(), self.process_group, what=f"{type(self).__name__} settings", device=device)
            self._settings_checked = True
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} has a {p.grad.layout} gradient; {type(self).__name__} "
                    "needs dense gradients (e.g. nn.Embedding(..., sparse=False))"
                )
        if not hook_mode and world_size > 1:
            params = self._used_on_any_rank(params)
        else:
            params = [p for p in params if p.grad is not None]
        entries = [(*self._route(p), p) for p in params]  # (group, path, param)
        voted = [(g, p, path) for g, path, p in entries if path != "adamw"]
        averaged = [(g, p, path) for g, path, p in entries if path == "adamw"]
        if hook_mode:
            # The hook left the vote in .grad; its sign undoes any rescaling since (clipping).
            # In place: a fresh tensor per parameter per step costs more than the sign itself.
            signs = [p.grad.sign_() for _, p, _ in voted]
            means = [p.grad for _, p, _ in averaged]
        elif self._node_layout() is not None:
            signs, means = self._node_aware(voted, averaged, self._node_layout())
        else:
            # A rank without a gradient for a parameter others train abstains (votes 0, adds 0).
            directions = [torch.zeros_like(p) if p.grad is None else self.local_direction(p, p.grad) for _, p, _ in voted]
            signs = self._vote(directions)
            means = self._average([torch.zeros_like(p) if p.grad is None else p.grad for _, p, _ in averaged])
        self._check_means(averaged, means)
        for (group, p, path), s in zip(voted, signs):
            update = self._post_vote(group, s, path)
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-step_size(group["lr"], group["lr_scaling"], p) if path == "matrix" else -group["lr"])
        for (group, p, _), g in zip(averaged, means):
            self._adamw_update(group, p, g, self.state[p])
        self.steps_taken += 1
        return loss

    def _used_on_any_rank(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with a gradient on some rank (the same list on every rank), after checking
        that every rank is at the same step: one all-gather of 1 + P words."""
        device = params[0].device if params else "cpu"
        row = torch.tensor([self.steps_taken] + [p.grad is not None for p in params], dtype=torch.int64, device=device)
        rows = gather_rows(row, self.process_group, self.stats)  # [M, 1 + P]
        steps = rows[:, 0].tolist()
        if len(set(steps)) > 1:
            raise VoteMismatchError(
                f"{type(self).__name__}.step() entered at different steps ("
                + "; ".join(f"rank {r}: step {s}" for r, s in enumerate(steps)) + "): resume every rank from the same checkpoint"
            )
        used = rows[:, 1:].any(dim=0).tolist()
        return [p for p, u in zip(params, used) if u]

    def owner(self, param: torch.Tensor, ranks_per_node: int) -> int:
        """The local rank that owns ``param``'s momentum and Newton–Schulz in the node-aware vote:
        every voted parameter, in param-group order, assigned by cost (``comm_hooks.owners``), so
        the same on every rank, every step and after a restart."""
        if self._owners is None or self._owners[0] != ranks_per_node:
            voted = [p for g in self.param_groups for p in g["params"] if self.votes(p)]
            assigned = owners([matrix_cost(p) for p in voted], ranks_per_node)
            self._owners = (ranks_per_node, dict(zip(voted, assigned)))
        return self._owners[1][param]

    def _node_layout(self) -> NodeLayout | None:
        """vote_in_step with ``VoteConfig(hierarchical=True)``: the node layout (made at the first
        step, on every rank alike), or None for the flat vote."""
        world_size, _ = group_size_rank(self.process_group)
        if not self.vote_config.hierarchical or world_size == 1:
            return None
        if self._layout is None:
            self._layout = node_layout(self.process_group, self.vote_config.ranks_per_node)
        return None if self._layout.flat else self._layout

    def _node_aware(self, voted: list, averaged: list, layout: NodeLayout) -> tuple[list, list]:
        """Node-aware vote_in_step: node-mean gradients, each parameter's momentum and direction
        on its owning local rank, signs voted between nodes (``comm_hooks.hierarchy``)."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for _, p, _ in voted]
        vote_owned(
            grads,
            lambda i, mean: self.local_direction(voted[i][1], mean),
            [self.owner(p, layout.ranks_per_node) for _, p, _ in voted],
            list(range(len(voted))),
            layout, self.vote_config, step=self.steps_taken, stats=self.stats,
            label=f"{type(self).__name__} step {self.steps_taken}", tag=self.steps_taken,
        )  # fmt: skip
        means = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for _, p, _ in averaged]
        if means:
            flat = torch.cat([m.reshape(-1) for m in means])
            world_mean(flat, layout, self.stats)
            means = [chunk.view_as(m) for chunk, m in zip(flat.split([m.numel() for m in means]), means)]
        return grads, means

    def _check_means(self, averaged: list, means: list[torch.Tensor]) -> None:
        """Before any AdamW parameter moves: a non-finite mean gradient raises (``"raise"``)."""
        if self.vote_config.nonfinite != "raise":
            return
        for (_, p, _), g in zip(averaged, means):
            if bool(nonfinite_flag(g)):
                raise NonFiniteError(f"NaN or Inf in the averaged gradient of a parameter of shape {tuple(p.shape)}")

    def _vote(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """One vote for all directions (flattened together), split back per parameter."""
        if not directions:
            return []
        flat = torch.cat([d.reshape(-1) for d in directions])
        sizes = [d.numel() for d in directions]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        segments = SignSegments(tuple(starts), tuple(range(len(sizes))))
        majority_vote(
            flat, self.process_group, self.vote_config, step=self.steps_taken, segments=segments, out=flat,
            stats=self.stats, label=f"SignMuon step {self.steps_taken}", tag=self.steps_taken,
            agree_sizes=False,  # the voted list is agreed by _used_on_any_rank, its shapes by settings()
        )  # fmt: skip
        return [chunk.view_as(d) for chunk, d in zip(flat.split([d.numel() for d in directions]), directions)]

    def _average(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        world_size, _ = group_size_rank(self.process_group)
        if world_size == 1 or not grads:
            return grads
        flat = torch.cat([g.reshape(-1) for g in grads])
        allreduce_mean(flat, self.process_group, self.stats, None).wait()  # _adamw_update skips or raises
        return [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)]

    # -- checkpointing ---------------------------------------------------------------------

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError now, not at the next step, if the saved state does not fit."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the checkpoint has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        saved_state = state_dict.get("state", {})
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {g} has {len(saved['params'])} parameters in the checkpoint, {len(group['params'])} here"
                )
            for index, p in zip(saved["params"], group["params"]):
                expected = self.state[p]
                got = saved_state.get(index, {})
                label = f"parameter {index} (shape {tuple(p.shape)}, group {g})"
                if set(got) != set(expected):
                    raise ValueError(f"{label}: the checkpoint's state has keys {sorted(got)}, expected {sorted(expected)}")
                for key, value in expected.items():
                    loaded = got[key]
                    if not torch.is_tensor(loaded) or loaded.shape != value.shape:
                        shape = tuple(loaded.shape) if torch.is_tensor(loaded) else type(loaded).__name__
                        raise ValueError(f"{label}: the checkpoint's {key} is {shape}, expected shape {tuple(value.shape)}")
                    if not loaded.is_floating_point():
                        raise ValueError(f"{label}: the checkpoint's {key} has dtype {loaded.dtype}, expected a float dtype")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        world_size, _ = group_size_rank(self.process_group)
        state["signmuon"] = {"steps_taken": self.steps_taken, "world_size": world_size}
        if self.checkpoint_all_ranks and world_size > 1:
            # The momentum is each worker's own (it runs before the vote): keep every rank's.
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, _to_cpu(state["state"]), group=self.process_group)
            state["signmuon"]["rank_states"] = gathered
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``, after checking it fits: same world size (the momentum is each
        rank's own), and per parameter the same state keys, shapes and floating dtypes."""
        extra = state_dict.get("signmuon", {"steps_taken": 0})
        state_dict = {k: v for k, v in state_dict.items() if k != "signmuon"}
        world_size, rank = group_size_rank(self.process_group)
        saved_world = len(extra["rank_states"]) if "rank_states" in extra else extra.get("world_size", world_size)
        if saved_world != world_size:
            raise ValueError(
                f"the checkpoint holds the local state of {saved_world} rank(s), but {world_size} rank(s) are "
                "loading it: each rank's momentum is its own, so resume on the same number of ranks"
            )
        if "rank_states" in extra:
            state_dict["state"] = extra["rank_states"][rank]
        self._check_loaded_state(state_dict)
        super().load_state_dict(state_dict)
        self.steps_taken = int(extra["steps_taken"])
        self._hook_iter_seen = self.steps_taken
        if self._comm_state is not None:
            self._comm_state.iter = self.steps_taken
            self._hook_raised_seen = self._comm_state.raised
