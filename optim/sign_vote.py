"""The sign-vote optimizer: every update is the majority vote of the workers' signs.

:class:`SignVoteOptimizer` holds what every sign-vote optimizer shares: state, the routing of
parameters to paths, the step loop and checkpoints. The math is the pure functions of
:mod:`~signmuon.optim.functional`, reached through the methods a subclass overrides (listed
once, in docs/design.md, "Adding an optimizer"). Where the vote happens is the optimizer's
:class:`~signmuon.optim.exchanges.Exchange`, chosen once (that module lists them). On several
ranks without one of them, ``step()`` raises rather than apply the wrong math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks import (
    BackwardReducer,
    CommStats,
    NonFiniteError,
    SignMuonHookState,
    VoteConfig,
    sign_muon_hook,
)
from signmuon.comm_hooks.ddp_group import resolve_group
from signmuon.comm_hooks.dist import nonfinite_flag

from .checkpoint import keep_saved_dtypes
from .exchanges import Exchange, HookExchange, InStepExchange
from .functional import signum_direction, step_size
from .newton_schulz import assign_owners, newton_schulz_cost
from .params import local_tensor, refuse_sparse, refuse_sparse_gradients, state_dtype
from .scaling import GradScalerSupport

__all__ = ["SignVoteOptimizer"]


def _nonfinite_means(averaged: list, means: list[torch.Tensor], *, raise_: bool) -> list[bool]:
    """Whether each mean gradient holds NaN or Inf: one host read for all (a read per parameter
    stalls a GPU); with ``raise_`` a NonFiniteError before any parameter moves."""
    bad_means = torch.stack([nonfinite_flag(g) for g in means]).tolist() if means else []
    for (_, p, _), bad in zip(averaged, bad_means):
        if bad and raise_:
            raise NonFiniteError(f"NaN or Inf in the averaged gradient of a parameter of shape {tuple(p.shape)}")
    return bad_means


def _settings(optimizer: "SignVoteOptimizer") -> dict[str, Any]:
    groups = [
        {
            **{k: v for k, v in g.items() if k not in ("params", "param_names")},
            "shapes": [tuple(p.shape) for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    options = ("vote_in_step", "checkpoint_all_ranks", "master_weights")
    return {
        "optimizer": type(optimizer).__name__,
        "vote": optimizer.vote_config.settings(),
        "groups": groups,
        **{name: getattr(optimizer, name) for name in options},
    }


class SignVoteOptimizer(GradScalerSupport, torch.optim.Optimizer):
    """Base of the sign-vote optimizers: ``W <- W - lr*vote(sign(direction_i)) - lr*lambda*W``.
    Subclasses set the defaults and override the math (docs/design.md, "Adding an optimizer");
    arguments as :class:`~signmuon.optim.SignumMV`."""

    whole_paths: tuple[str, ...] = ()  # paths whose whole_direction needs the whole tensor
    fixed_settings: tuple[str, ...] = ("exchange",)  # what a spec may not set (sign_optimizer_from_spec)

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
        exchange: Exchange | None = None,
    ) -> None:
        self.vote_config = VoteConfig.of(vote)
        self.master_weights = bool(master_weights)
        self.vote_in_step = bool(vote_in_step)
        self.checkpoint_all_ranks = bool(checkpoint_all_ranks)
        self.steps_taken = 0  # optimizer steps so far: the one iteration counter (checkpointed)
        self.stats = CommStats()  # bytes step() sends itself (vote_in_step); the hook has its own
        self._paths: dict[torch.Tensor, tuple[int, str]] = {}  # param -> (group index, path)
        self._owners: tuple[int, dict[torch.Tensor, int]] | None = None  # (L, param -> owning local rank)
        self.process_group = process_group  # sets the default exchange, voting in step()
        if exchange is not None:  # before the groups: it says where their state lives
            self.exchange = exchange
        super().__init__(params, defaults)
        if exchange is not None:
            exchange.check_serves(self)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks that vote (None = WORLD). Setting it (as DeepSpeed's engine does with its
        data-parallel group) moves ``vote_in_step``'s vote there; set it before any hook."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        if hasattr(self, "exchange") and not isinstance(self.exchange, InStepExchange):
            raise RuntimeError(f"set process_group before {type(self.exchange).__name__} is chosen, not after")
        self._process_group = group
        self.exchange: Exchange = InStepExchange(group, self.vote_config, self.stats)

    def use_exchange(self, exchange: Exchange) -> None:
        """Vote through ``exchange`` from now on; once, in place of voting in ``step()``."""
        if not isinstance(self.exchange, InStepExchange):
            raise RuntimeError(
                f"{type(self).__name__} already votes through {type(self.exchange).__name__}; an optimizer "
                "takes one of the DDP hook, the backward reducer and register_fsdp_vote"
            )
        exchange.check_serves(self)
        if self.grad_scaler is not None:
            exchange.use_grad_scaler(self, self.grad_scaler)
        self.exchange = exchange

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
        """Which update ``param`` takes: ``"signum"`` here (the vote of the momentum's sign);
        ``"adamw"`` means its gradient is mean all-reduced (:meth:`apply_mean`)."""
        return "signum"

    def init_state(self, state: dict[str, Any], param: torch.Tensor, path: str) -> None:
        """Eager, rank-symmetric state: the same keys and shapes on every rank from step 0."""
        state["momentum_buffer"] = torch.zeros_like(
            self.exchange.local_part(param), dtype=state_dtype(param), memory_format=torch.preserve_format
        )
        self.init_master(state, param)

    def init_master(self, state: dict[str, Any], param: torch.Tensor) -> None:
        """With ``master_weights``, a float32 copy of a 16-bit parameter, which the updates go to."""
        if self.master_weights and state_dtype(param) != param.dtype:
            state["master_weight"] = self.local_part(param).detach().to(torch.float32, copy=True)

    def local_part(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``param``: its shard (FSDP2), its piece of a ZeRO partition, or itself."""
        return local_tensor(self.exchange.local_part(param))

    def update_target(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor an update goes to: the master weight if there is one, else :meth:`local_part`."""
        master = self.state[param].get("master_weight")
        return self.local_part(param) if master is None else master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.exchange.params_changed(self)
        super().add_param_group(param_group)
        group, index = self.param_groups[-1], len(self.param_groups) - 1
        self.check_group(group)
        self._owners = None  # ownership is recomputed with the new parameters
        names = group.get("param_names") or [None] * len(group["params"])
        for position, (p, name) in enumerate(zip(group["params"], names)):
            label = name or f"parameter {position} of group {index} (shape {tuple(p.shape)})"
            refuse_sparse(p, label, type(self).__name__)
            try:
                self._paths[p] = (index, self.path(group, p))
            except ValueError as error:
                raise ValueError(f"{label}: {error}") from None
            self.init_state(self.state[p], p, self._paths[p][1])

    def route(self, param: torch.Tensor) -> tuple[dict[str, Any], str]:
        """(param group, path) of ``param``."""
        if param not in self._paths:
            name = type(self).__name__
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} is not managed by this {name}: the vote must know "
                f"every parameter of the model it serves, so pass them all to the one {name} (SignMuon's "
                "non_matrix='adamw' gives the non-matrix ones AdamW on the mean gradient), or keep the others "
                "out of the DDP model the hook is registered on"
            )
        index, path = self._paths[param]
        return self.param_groups[index], path

    def votes(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s update is voted (else its gradient is mean all-reduced)."""
        return self.route(param)[1] != "adamw"

    def split_by_path(self, params: list[torch.Tensor]) -> tuple[list, list]:
        """(voted, averaged): (group, param, path) of each parameter, by whether its update is voted."""
        entries = [(*self.route(p), p) for p in params]
        voted = [(g, p, path) for g, path, p in entries if path != "adamw"]
        return voted, [(g, p, path) for g, path, p in entries if path == "adamw"]

    # -- the math: pure functions, one call each --------------------------------------------

    @torch.no_grad()
    def elementwise_direction(
        self, param: torch.Tensor, grad: torch.Tensor, present: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The part of the pre-vote half that works entry by entry (on a shard too): advance
        ``param``'s momentum with ``grad`` (:func:`~signmuon.optim.functional.signum_direction`);
        ``present`` (0-d bool) unset: this worker has no gradient, abstains, its momentum stays."""
        group, _ = self.route(param)
        return signum_direction(
            grad,
            self.state[param]["momentum_buffer"],
            group["momentum"],
            nesterov=group.get("nesterov", False),
            param=self.update_target(param),
            coupled_weight_decay=group.get("coupled_weight_decay", 0.0),
            present=present,
        )

    def whole_direction(self, param: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """The part that needs the whole tensor, on :attr:`whole_paths` (Newton–Schulz in SignMuon)."""
        return direction

    @torch.no_grad()
    def local_direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Pre-vote half on this worker: :meth:`elementwise_direction`, then :meth:`whole_direction`
        (skipped where the direction is a non-finite gradient itself: every rank skips the vote).

        A gradient that is zero everywhere counts as none (the worker abstains, its momentum stays
        put): DDP hands zeros to a rank that has no gradient (under ``Join``, a parameter unused on
        this rank), and an exactly zero gradient of a whole tensor cannot be told from that."""
        direction = self.elementwise_direction(param, grad, grad.ne(0).any())
        if self.route(param)[1] not in self.whole_paths or direction is grad and bool(nonfinite_flag(grad)):
            return direction
        return self.whole_direction(param, direction)

    def finishes(self, group: dict[str, Any], path: str) -> bool:
        """Whether :meth:`finish_vote` runs on ``path``: on whole tensors where ``polar_after_vote``."""
        return path in self.whole_paths and bool(group.get("polar_after_vote"))

    def finish_vote(self, group: dict[str, Any], param: torch.Tensor, voted: torch.Tensor, path: str) -> torch.Tensor:
        """The update D from the voted signs (here the signs themselves)."""
        return voted

    def step_length(self, group: dict[str, Any], param: torch.Tensor, path: str) -> float:
        """How far a unit of the update moves an entry: ``lr``, on whole tensors as ``lr_scaling`` says."""
        whole = path in self.whole_paths
        return step_size(group["lr"], group.get("lr_scaling", "global"), param) if whole else group["lr"]

    def apply_mean(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, nonfinite: bool) -> None:
        """The update of a parameter whose mean gradient ``grad`` was all-reduced (no such path
        here); ``nonfinite``: it holds NaN or Inf (the same on every rank)."""
        raise NotImplementedError(f"{type(self).__name__} votes every parameter")

    def settings(self) -> dict[str, Any]:
        """What must be equal on every rank: hyperparameters and parameter shapes."""
        return _settings(self)

    def owner(self, param: torch.Tensor, ranks_per_node: int) -> int:
        """The local rank that owns ``param``'s momentum (and Newton–Schulz) in the node-aware
        vote: every voted parameter, in param-group order, assigned by cost, so the same on every
        rank, every step and after a restart."""
        if self._owners is None or self._owners[0] != ranks_per_node:
            voted = [p for g in self.param_groups for p in g["params"] if self.votes(p)]
            assigned = assign_owners([newton_schulz_cost(p) for p in voted], ranks_per_node)
            self._owners = (ranks_per_node, dict(zip(voted, assigned)))
        return self._owners[1][param]

    # -- the DDP hook: an exchange ---------------------------------------------------------

    @property
    def comm_state(self) -> SignMuonHookState:
        """The hook state; asking for it makes the hook this optimizer's exchange."""
        if not isinstance(self.exchange, HookExchange):
            self.use_exchange(HookExchange(SignMuonHookState(self, self.process_group, vote=self.vote_config)))
        return self.exchange.state

    @property
    def has_comm_hook(self) -> bool:
        """Whether a hook (DDP's or :meth:`register_backward_reducer`'s) does the pre-vote half."""
        return isinstance(self.exchange, HookExchange)

    def register_comm_hook(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> SignMuonHookState:
        """``ddp_model.register_comm_hook(self.comm_state, sign_muon_hook)``; returns the state.
        The vote runs over DDP's process group (a ``process_group`` given here must have its ranks)."""
        if isinstance(self.exchange, InStepExchange):
            group, refusal = resolve_group(self.process_group, ddp_model.process_group, type(self).__name__)
            if refusal is not None:
                raise ValueError(refusal)
            self.process_group = group
        ddp_model.register_comm_hook(self.comm_state, sign_muon_hook)
        return self.comm_state

    def register_backward_reducer(
        self, *, sync: Callable[[], bool] | None = None, bucket_cap_mb: float = 25.0
    ) -> BackwardReducer:
        """Without DDP (a DeepSpeed engine, a hand-written loop): :func:`~signmuon.comm_hooks.sign_muon_hook`
        on buckets as backward produces them; ``step()`` applies the vote. ``sync``: whether this
        backward ends a gradient-accumulation window. Set ``process_group`` before calling."""
        if self.vote_in_step:
            raise ValueError("register_backward_reducer() votes in backward; create the optimizer without vote_in_step")
        params = [p for group in self.param_groups for p in group["params"]]
        return BackwardReducer(params, self.comm_state, sign_muon_hook, sync=sync, bucket_cap_mb=bucket_cap_mb)

    # -- step and checkpoints --------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = None if closure is None else closure()
        name = type(self).__name__
        params = [p for group in self.param_groups for p in group["params"]]
        refuse_sparse_gradients(params, name)
        voted, signs, averaged, means = self.exchange.exchange(self, params, name)
        bad_means = _nonfinite_means(averaged, means, raise_=self.vote_config.nonfinite == "raise")
        for (group, p, path), s in zip(voted, signs):
            update = s if self.exchange.finishes_vote else self.finish_vote(group, p, s, path)
            target = self.update_target(p)
            if group["weight_decay"]:
                target.mul_(1 - group["lr"] * group["weight_decay"])
            target.add_(update, alpha=-self.step_length(group, p, path))
        for (group, p, _), g, bad in zip(averaged, means, bad_means):
            self.apply_mean(group, p, g, bad)
        for _, p, _ in voted + averaged:
            if "master_weight" in self.state[p]:
                self.local_part(p).copy_(self.state[p]["master_weight"])  # the parameter: the master, rounded
        self.steps_taken += 1
        self.exchange.stepped()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the step count and whose state it is (rank, world size), as the
        exchange saves it (with ``checkpoint_all_ranks``, a collective; on FSDP shards, DTensors for DCP)."""
        return self.exchange.state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``, after checking it fits: same world size and this rank's own
        momentum (each rank's is its own: another rank's state is refused, on every rank at once,
        so on several ranks every rank loads), and per parameter the same state keys, shapes and
        floating dtypes. State keeps the dtype it was saved in (float32 momentum of bfloat16
        parameters stays float32)."""
        loaded = self.exchange.load_state_dict(self, state_dict)
        super().load_state_dict(loaded)
        keep_saved_dtypes(self, loaded)
        self.steps_taken = int(loaded["signmuon"]["steps_taken"])
        self.exchange.stepped()
