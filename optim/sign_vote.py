"""The sign-vote optimizer: every update is the majority vote of the workers' signs.

:class:`SignVoteOptimizer` holds what every sign-vote optimizer shares (state, routing of
parameters, the step loop, the DDP hook, checkpoints); the math is the pure functions of
:mod:`~signmuon.optim.functional`, reached through one method, :meth:`~SignVoteOptimizer.local_direction`.
:class:`SignumMV` and :class:`SignSGDMV` are the base as it is; ``SignMuon`` overrides the
direction of matrices (Newton–Schulz) and adds an AdamW path.

Where the pre-vote half (momentum, direction) runs:

* under DDP, in :func:`~signmuon.comm_hooks.sign_muon_hook`, on each worker's local gradient,
  overlapped with backward: ``opt.register_comm_hook(ddp_model)``; ``step()`` then applies the
  sign of what the vote left in ``.grad``;
* on one process, all of it in ``step()``;
* with ``vote_in_step=True``, ``step()`` votes across ``process_group`` itself
  (:class:`~signmuon.comm_hooks.step_vote.StepVoter`).

On several ranks without either, ``step()`` raises rather than silently applying the wrong math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from signmuon.comm_hooks import (
    BackwardReducer,
    CommStats,
    NonFiniteError,
    SignMuonHookState,
    VoteConfig,
    sign_muon_hook,
)
from signmuon.comm_hooks.dist import nonfinite_flag
from signmuon.comm_hooks.step_vote import StepVoter
from signmuon.comm_hooks.vote import matrix_cost, owners

from .checkpoint import keep_saved_dtypes, load_rank_state, rank_state_dict
from .exchanges import from_hook, in_step, refuse_dtensors
from .functional import signum_direction

if TYPE_CHECKING:
    from .fsdp import ShardedVote

__all__ = ["SignVoteOptimizer", "SignumMV", "SignSGDMV", "local_tensor", "state_dtype"]


def _refuse_sparse(param: torch.Tensor, label: str, optimizer: str) -> None:
    """A sparse parameter fails here, by name, not deep in a kernel."""
    if param.layout != torch.strided:
        raise ValueError(f"{label} is a {param.layout} tensor; {optimizer} needs dense parameters")


def _refuse_sparse_gradients(params: list[torch.Tensor], optimizer: str) -> None:
    for p in params:
        if p.grad is not None and p.grad.layout != torch.strided:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has a {p.grad.layout} gradient; {optimizer} "
                "needs dense gradients (e.g. nn.Embedding(..., sparse=False))"
            )


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's optimizer state: float32 for 16-bit parameters (momentum
    and Newton–Schulz keep their precision), else the parameter's own."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its storage, so in-place updates land), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SignVoteOptimizer(torch.optim.Optimizer):
    """Base of the sign-vote optimizers: ``W <- W - lr*vote(sign(direction_i)) - lr*lambda*W``.
    Subclasses set the defaults and override :meth:`local_direction` (for other paths also
    :meth:`path`, :meth:`whole_direction`, :meth:`finish_vote`, :meth:`step_length`,
    :meth:`apply_mean`); arguments as :class:`SignumMV`."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        vote: VoteConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        vote_in_step: bool = False,
        checkpoint_all_ranks: bool = False,
        master_weights: bool = False,
    ) -> None:
        vote = VoteConfig.of(vote)
        self.master_weights = bool(master_weights)
        self.vote_config = vote
        self.vote_in_step = bool(vote_in_step)
        self.checkpoint_all_ranks = bool(checkpoint_all_ranks)
        self.steps_taken = 0  # optimizer steps so far: the one iteration counter (checkpointed)
        self.stats = CommStats()  # bytes step() sends itself (vote_in_step); the hook has its own
        self.process_group = process_group  # builds the voter of vote_in_step
        self._comm_state: SignMuonHookState | None = None
        self._paths: dict[torch.Tensor, tuple[int, str]] = {}  # param -> (group index, path)
        self._owners: tuple[int, dict[torch.Tensor, int]] | None = None  # (L, param -> owning local rank)
        self.sharded_vote: "ShardedVote | None" = None
        """The FSDP vote's mesh, voter and shard layout, set by :func:`~signmuon.optim.register_fsdp_vote`."""
        super().__init__(params, defaults)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks that vote (None = WORLD). Setting it (as DeepSpeed's engine does with its
        data-parallel group) also moves ``vote_in_step``'s vote there."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self._process_group = group
        self._voter = StepVoter(group, self.vote_config, self.stats)

    # -- parameter routing and eager state ------------------------------------------------

    def check_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a setting out of range (every group, at ``add_param_group``)."""
        if not group["lr"] >= 0:
            raise ValueError(f"lr={group['lr']} must be >= 0")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum={group['momentum']} must be in [0, 1)")
        if not group["weight_decay"] >= 0:
            raise ValueError(f"weight_decay={group['weight_decay']} must be >= 0")

    def path(self, group: dict[str, Any], param: torch.Tensor) -> str:
        """Which update ``param`` takes: ``"signum"`` here (the vote of the momentum's sign)."""
        return "signum"

    def init_state(self, state: dict[str, Any], param: torch.Tensor, path: str) -> None:
        """Eager, rank-symmetric state: the same keys and shapes on every rank from step 0."""
        state["momentum_buffer"] = torch.zeros_like(
            param, dtype=state_dtype(param), memory_format=torch.preserve_format
        )
        self.init_master(state, param)

    def init_master(self, state: dict[str, Any], param: torch.Tensor) -> None:
        """With ``master_weights``, a float32 copy of a 16-bit parameter, which the updates go to."""
        if self.master_weights and state_dtype(param) != param.dtype:
            state["master_weight"] = local_tensor(param).detach().to(torch.float32, copy=True)

    def update_target(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor an update goes to: the master weight if there is one, else (this rank's part of) ``param``."""
        master = self.state[param].get("master_weight")
        return local_tensor(param) if master is None else master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "sharded_vote", None) is not None:
            raise ValueError(
                "add param groups before register_fsdp_vote: it lays out the shards of the parameters it sees"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.check_group(group)
        self._voter.settings_changed()  # the new shapes are compared at the next step
        self._owners = None  # ownership is recomputed with the new parameters
        names = group.get("param_names") or [None] * len(group["params"])
        for index, (p, name) in enumerate(zip(group["params"], names)):
            label = name or f"parameter {index} of group {len(self.param_groups) - 1} (shape {tuple(p.shape)})"
            _refuse_sparse(p, label, type(self).__name__)
            try:
                path = self.path(group, p)
            except ValueError as error:
                raise ValueError(f"{label}: {error}") from None
            self._paths[p] = (len(self.param_groups) - 1, path)
            self.init_state(self.state[p], p, path)

    def _route(self, param: torch.Tensor) -> tuple[dict[str, Any], str]:
        """(param group, path) of ``param``."""
        if param not in self._paths:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not managed by this {type(self).__name__}")
        index, path = self._paths[param]
        return self.param_groups[index], path

    def votes(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s update is voted (else its gradient is mean all-reduced)."""
        return self._route(param)[1] != "adamw"

    # -- the math: pure functions, one call each --------------------------------------------

    @torch.no_grad()
    def elementwise_direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The part of the pre-vote half that works entry by entry (on a shard too): advance
        ``param``'s momentum with ``grad`` (:func:`~signmuon.optim.functional.signum_direction`)."""
        group, _ = self._route(param)
        return signum_direction(
            grad,
            self.state[param]["momentum_buffer"],
            group["momentum"],
            nesterov=group.get("nesterov", False),
            param=self.update_target(param),
            coupled_weight_decay=group.get("coupled_weight_decay", 0.0),
        )

    def needs_whole(self, param: torch.Tensor) -> bool:
        """Whether :meth:`whole_direction` needs the whole tensor (none here)."""
        return False

    def whole_direction(self, param: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """The part that needs the whole tensor (identity here; Newton–Schulz in SignMuon)."""
        return direction

    @torch.no_grad()
    def local_direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Pre-vote half on this worker: :meth:`elementwise_direction`, then :meth:`whole_direction`.
        A non-finite gradient leaves a non-finite direction (every rank then skips the vote);
        where the direction is the gradient itself, the whole-tensor step is skipped too."""
        direction = self.elementwise_direction(param, grad)
        if not self.needs_whole(param) or direction is grad and bool(nonfinite_flag(grad)):
            return direction
        return self.whole_direction(param, direction)

    def finishes(self, group: dict[str, Any], path: str) -> bool:
        """Whether :meth:`finish_vote` changes the voted signs on ``path`` (it needs the whole tensor)."""
        return False

    def finish_vote(self, group: dict[str, Any], param: torch.Tensor, voted: torch.Tensor, path: str) -> torch.Tensor:
        """The update D from the voted signs (here the signs themselves)."""
        return voted

    def step_length(self, group: dict[str, Any], param: torch.Tensor, path: str) -> float:
        """How far one unit of the update moves an entry."""
        return group["lr"]

    def apply_mean(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, nonfinite: bool) -> None:
        """The update of a parameter whose mean gradient ``grad`` was all-reduced (no such path
        here); ``nonfinite``: it holds NaN or Inf (the same on every rank)."""
        raise NotImplementedError(f"{type(self).__name__} votes every parameter")

    def settings(self) -> dict[str, Any]:
        """What must be equal on every rank: hyperparameters and parameter shapes."""
        groups = [
            {
                **{k: v for k, v in g.items() if k not in ("params", "param_names")},
                "shapes": [tuple(p.shape) for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {
            "optimizer": type(self).__name__,
            "vote": self.vote_config.settings(),
            "vote_in_step": self.vote_in_step,
            "checkpoint_all_ranks": self.checkpoint_all_ranks,
            "master_weights": self.master_weights,
            "groups": groups,
        }

    def owner(self, param: torch.Tensor, ranks_per_node: int) -> int:
        """The local rank that owns ``param``'s momentum (and Newton–Schulz) in the node-aware
        vote: every voted parameter, in param-group order, assigned by cost, so the same on every
        rank, every step and after a restart."""
        if self._owners is None or self._owners[0] != ranks_per_node:
            voted = [p for g in self.param_groups for p in g["params"] if self.votes(p)]
            assigned = owners([matrix_cost(p) for p in voted], ranks_per_node)
            self._owners = (ranks_per_node, dict(zip(voted, assigned)))
        return self._owners[1][param]

    # -- DDP hook --------------------------------------------------------------------------

    @property
    def comm_state(self) -> SignMuonHookState:
        """The hook state; asking for it tells ``step()`` that the hook does the pre-vote half."""
        if self._comm_state is None:
            if self.sharded_vote is not None:
                raise RuntimeError(
                    f"{type(self).__name__} votes FSDP shards (register_fsdp_vote); it cannot also take a DDP hook"
                )
            refuse_dtensors([p for g in self.param_groups for p in g["params"]], type(self).__name__)
            self._comm_state = SignMuonHookState(self, self.process_group, vote=self.vote_config)
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
        """Without DDP: run :func:`~signmuon.comm_hooks.sign_muon_hook` on buckets as backward
        produces them (a DeepSpeed engine, a hand-written loop): after ``loss.backward()`` the
        gradients hold the vote and ``step()`` applies it. ``sync`` says whether this backward
        ends a gradient-accumulation window. Set ``process_group`` before calling.
        """
        if self.vote_in_step:
            raise ValueError(
                "register_backward_reducer() votes in backward; create the optimizer with vote_in_step=False"
            )
        params = [p for group in self.param_groups for p in group["params"]]
        return BackwardReducer(params, self.comm_state, sign_muon_hook, sync=sync, bucket_cap_mb=bucket_cap_mb)

    # -- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        params = [p for group in self.param_groups for p in group["params"]]
        _refuse_sparse_gradients(params, name)
        voted, signs, averaged, means = self.exchange(params, name)
        # One host read for all the averaged gradients' flags (a read per parameter stalls a GPU).
        bad_means = torch.stack([nonfinite_flag(g) for g in means]).tolist() if means else []
        if self.vote_config.nonfinite == "raise":  # before any parameter moves
            for (_, p, _), bad in zip(averaged, bad_means):
                if bad:
                    raise NonFiniteError(
                        f"NaN or Inf in the averaged gradient of a parameter of shape {tuple(p.shape)}"
                    )
        for (group, p, path), s in zip(voted, signs):
            # Sharded: finish_vote ran on the whole tensor at its owner.
            update = s if self.sharded_vote is not None else self.finish_vote(group, p, s, path)
            target = self.update_target(p)
            if group["weight_decay"]:
                target.mul_(1 - group["lr"] * group["weight_decay"])
            target.add_(update, alpha=-self.step_length(group, p, path))
        for (group, p, _), g, bad in zip(averaged, means, bad_means):
            self.apply_mean(group, p, g, bad)
        for _, p, _ in voted + averaged:
            if "master_weight" in self.state[p]:
                local_tensor(p).copy_(self.state[p]["master_weight"])  # the parameter: the master, rounded
        self.steps_taken += 1
        if self._comm_state is not None:
            self._comm_state.stepped()  # the backward pass it checked is now stepped
        return loss

    def exchange(self, params: list[torch.Tensor], name: str) -> tuple[list, list, list, list]:
        """(voted, their signs, averaged, their mean gradients) of this step: from the FSDP
        exchange, from the DDP hook's work, or voted here (``vote_in_step``)."""
        if self.sharded_vote is not None:
            return self.sharded_vote.exchange(self, params, name)
        refuse_dtensors(params, name)
        if self._comm_state is not None:
            return from_hook(self, self._comm_state, params, name)
        return in_step(self, self._voter, params, name)

    def split_by_path(self, params: list[torch.Tensor]) -> tuple[list, list]:
        """(voted, averaged): (group, param, path) of each parameter, by whether its update is voted."""
        entries = [(*self._route(p), p) for p in params]
        return [(g, p, path) for g, path, p in entries if path != "adamw"], [
            (g, p, path) for g, path, p in entries if path == "adamw"
        ]

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the step count and world size; with ``checkpoint_all_ranks``
        a collective gathering every rank's momentum (see :func:`~signmuon.optim.checkpoint.rank_state_dict`).
        On FSDP shards, the DTensors ``torch.distributed.checkpoint`` saves (see :mod:`~signmuon.optim.fsdp`)."""
        if self.sharded_vote is not None:
            return self.sharded_vote.state_dict(self, super().state_dict())
        return rank_state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``, after checking it fits: same world size (the momentum is each
        rank's own), and per parameter the same state keys, shapes and floating dtypes. State
        keeps the dtype it was saved in (float32 momentum of bfloat16 parameters stays float32)."""
        if self.sharded_vote is not None:
            state_dict = self.sharded_vote.local_state(self, state_dict)
        loaded = load_rank_state(self, state_dict)
        super().load_state_dict(loaded)
        keep_saved_dtypes(self, loaded)
        self.steps_taken = int(state_dict.get("signmuon", {}).get("steps_taken", 0))
        if self._comm_state is not None:
            self._comm_state.stepped()


class SignumMV(SignVoteOptimizer):
    """Signum with majority vote (Bernstein et al., ICLR 2019): ``m <- beta*m + (1-beta)*g`` on
    each worker, ``W <- W - lr*vote(sign(m)) - lr*lambda*W``.

    Under DDP the plain ``sign_vote_hook`` + ``torch.optim.SGD`` does the same with per-bucket
    momentum; this class serves where the optimizer must own the momentum (DeepSpeed,
    ``vote_in_step``) and where ``.grad`` may be rescaled before ``step()`` (clipping,
    GradScaler, accumulation averaging: ``step()`` takes the sign of what the vote left).

    Args:
        params: parameters or param groups.
        lr: each entry moves by ``lr`` per step (or 0 where the vote is 0).
        momentum: beta in [0, 1); 0 is signSGD-MV.
        weight_decay: decoupled weight decay lambda (``W -= lr*lambda*W``).
        vote: the vote's settings (:class:`~signmuon.comm_hooks.VoteConfig`: tie mode, seed,
            algorithm, kernels, ``hierarchical``, and ``nonfinite``: if any rank's gradient
            holds NaN or Inf, ``"skip"`` moves no voted entry that step, counted in
            ``stats.skipped``, the rank with the bad gradient keeping its momentum; ``"raise"``
            raises on every rank). Also used by the DDP hook.
        process_group: ranks that vote (None = WORLD).
        vote_in_step: let ``step()`` vote across ``process_group`` itself (no DDP hook).
        checkpoint_all_ranks: make ``state_dict()`` a collective that gathers every rank's
            local momentum into the one dict (so a checkpoint written by rank 0 alone, as
            DeepSpeed writes it, resumes every rank exactly; ``load_state_dict`` picks this
            rank's part). Off by default: then each rank saves its own ``state_dict()``.
        master_weights: keep a float32 copy of every 16-bit (bf16, fp16) parameter in the state;
            updates go to it and the parameter becomes its rounded copy, so steps smaller than
            the parameter's 16-bit spacing add up. Momentum is float32 for 16-bit parameters
            either way.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.9,
        *,
        weight_decay: float = 0.0,
        vote: VoteConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        vote_in_step: bool = False,
        checkpoint_all_ranks: bool = False,
        master_weights: bool = False,
    ) -> None:
        super().__init__(
            params,
            dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
            vote=vote,
            process_group=process_group,
            vote_in_step=vote_in_step,
            checkpoint_all_ranks=checkpoint_all_ranks,
            master_weights=master_weights,
        )

    def check_group(self, group: dict[str, Any]) -> None:
        if group.get("use_muon") or group.get("non_matrix", "signum") != "signum":
            raise ValueError(f"{type(self).__name__} votes the sign of every parameter; use SignMuon for other paths")
        super().check_group(group)


class SignSGDMV(SignumMV):
    """signSGD with majority vote: Signum without momentum (each worker votes sign(g)).
    Arguments as :class:`SignumMV`, without ``momentum``."""

    fixed_settings = ("momentum",)  # what a spec may not set (sign_optimizer_from_spec)

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3, **options: Any
    ) -> None:
        if "momentum" in options:
            raise TypeError("SignSGDMV has no momentum: it is SignumMV with momentum=0")
        super().__init__(params, lr, 0.0, **options)
