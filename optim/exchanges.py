"""Where a sign-vote optimizer's ``step()`` gets its voted signs and mean gradients: the one
protocol, :class:`Exchange`, and its unsharded implementations.

An optimizer holds one exchange, chosen once:

* :class:`InStepExchange` (the default): alone, the local signs; with ``vote_in_step=True``,
  the vote across ``process_group`` inside ``step()``;
* :class:`HookExchange`: the DDP hook (or the backward reducer) ran the pre-vote half and the
  vote during backward, and left the vote in ``.grad``;
* :class:`~signmuon.optim.fsdp_exchange.ShardedExchange`: FSDP2 shards, voted between nodes;
* :class:`~signmuon.integrations.deepspeed.zero_muon.ZeroExchange`: DeepSpeed ZeRO's flat
  partitions, voted between nodes (given at construction: it says where each parameter's state
  lives, :meth:`Exchange.local_part`).

Each returns :class:`Exchanged`; the optimizer's step loop is the same for all.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from signmuon.comm_hooks import CommStats, SignMuonHookState, VoteConfig
from signmuon.comm_hooks.step_vote import StepVoter

from .checkpoint import load_rank_state, rank_state_dict

__all__ = ["Exchange", "Exchanged", "HookExchange", "InStepExchange", "refuse_dtensors"]


class Exchanged(NamedTuple):
    """One step's result of an exchange."""

    voted: list
    """(param group, param, path) of each voted parameter."""
    signs: list[torch.Tensor]
    """The voted update of each (this rank's part of it, on shards)."""
    averaged: list
    """(param group, param, path) of each parameter whose gradient is averaged."""
    means: list[torch.Tensor]
    """The mean gradient of each."""


class Exchange:
    """How an optimizer's ``step()`` meets the other ranks. Override :meth:`exchange`; the rest
    has the unsharded defaults."""

    finishes_vote = False
    """Whether :meth:`exchange` already applied ``finish_vote`` (at the rank that owns the whole tensor)."""

    def exchange(self, optimizer, params: list[torch.Tensor], name: str) -> Exchanged:
        """This step's voted signs and mean gradients of ``params`` (every managed parameter)."""
        raise NotImplementedError

    def check_serves(self, optimizer) -> None:
        """Raise if this exchange cannot serve ``optimizer`` (when it is chosen)."""

    def local_part(self, param: torch.Tensor) -> torch.Tensor:
        """What ``param``'s state is shaped like and (its local shard) its update goes to: ``param``
        itself (a DTensor keeps DTensor state until the FSDP vote takes its shards)."""
        return param

    def params_changed(self, optimizer) -> None:
        """``add_param_group`` is about to add parameters (raise to refuse them)."""

    def stepped(self) -> None:
        """``step()`` (or a load) has applied what the last exchange gave."""

    def use_grad_scaler(self, optimizer, scaler) -> None:
        """The optimizer trains under a GradScaler (:mod:`~signmuon.optim.scaling`); raise where
        this exchange cannot take its loss scale into account."""
        raise ValueError(
            f"{type(self).__name__} does not divide by a GradScaler's loss scale before the momentum: train in "
            "bf16 without a scaler, or vote through the DDP hook or vote_in_step"
        )

    def needs_grad_scaler(self, optimizer) -> bool:
        """Whether a GradScaler stepping the optimizer must have been given to it."""
        return True

    def before_unscale(self, optimizer) -> None:
        """Called by the given GradScaler's ``unscale_`` before it looks for NaN or Inf."""

    def state_dict(self, optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """torch's ``state`` as this exchange saves it."""
        return rank_state_dict(optimizer, state)

    def load_state_dict(self, optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`state_dict`: torch's state dict for this rank, checked to fit,
        with ``{"signmuon": {"steps_taken": ...}}``."""
        steps = state_dict.get("signmuon", {}).get("steps_taken", 0)
        return {**load_rank_state(optimizer, state_dict), "signmuon": {"steps_taken": steps}}


def refuse_dtensors(params: list[torch.Tensor], name: str) -> None:
    """DTensor (FSDP2) parameters need the FSDP vote; say so instead of failing in a kernel."""
    if any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            f"{name} has DTensor parameters (a model sharded by FSDP2's fully_shard) but no FSDP vote: call "
            "signmuon.optim.register_fsdp_vote(model, optimizer, mesh) with the (node, local) mesh of "
            "signmuon.optim.node_mesh(), and shard over mesh['local']; the DDP hook and vote_in_step vote whole tensors"
        )


class HookExchange(Exchange):
    """The DDP hook (or the backward reducer) voted during backward."""

    def __init__(self, state: SignMuonHookState) -> None:
        self.state = state

    def check_serves(self, optimizer) -> None:
        refuse_dtensors([p for g in optimizer.param_groups for p in g["params"]], type(optimizer).__name__)

    def exchange(self, optimizer, params: list[torch.Tensor], name: str) -> Exchanged:
        """The hook left the vote in ``.grad`` (and the mean of averaged parameters): its sign undoes
        any rescaling since (clipping), taken in place (a fresh tensor per parameter per step costs
        more than the sign itself). A bucket's vote skipped for NaN or Inf skips every voted
        parameter, as ``vote_in_step``'s one vote of the step (and the FSDP vote) does."""
        refuse_dtensors(params, name)
        self.state.check_one_pass(name)
        unhooked = [tuple(p.shape) for p in params if p.grad is not None and id(p) not in self.state.hooked]
        if unhooked:  # its .grad is this rank's own: its sign would step each replica its own way
            raise RuntimeError(
                f"{name}.step(): parameters of shapes {unhooked} have a gradient no hook call voted: DDP reduces only "
                "the parameters that had requires_grad when it was built, so one unfrozen later is never voted. Set "
                "requires_grad before building DDP (after unfreezing, build DDP again and register the hook on it)"
            )
        voted, averaged = optimizer.split_by_path([p for p in params if p.grad is not None])
        signs = [p.grad.sign_() for _, p, _ in voted]
        if self.state.skipped_since_step():
            signs = [s.zero_() for s in signs]
        return Exchanged(voted, signs, averaged, [p.grad for _, p, _ in averaged])

    def stepped(self) -> None:
        self.state.stepped()  # the backward pass it checked is now stepped

    def use_grad_scaler(self, optimizer, scaler) -> None:
        """Nothing to set up: the hook reads the scale at each pass, and hands a skipped vote on as NaN."""


class InStepExchange(Exchange):
    """Vote inside ``step()`` across ``group`` (alone: the local signs)."""

    def __init__(self, group: dist.ProcessGroup | None, config: VoteConfig, stats: CommStats) -> None:
        self.voter = StepVoter(group, config, stats)

    def params_changed(self, optimizer) -> None:
        self.voter.settings_changed()  # the new shapes are compared at the next step

    def use_grad_scaler(self, optimizer, scaler) -> None:
        """Nothing to set up: ``step()`` gets unscaled gradients; :meth:`before_unscale` agrees on NaN or Inf."""

    def needs_grad_scaler(self, optimizer) -> bool:
        return self.voter.world_size > 1  # alone, step() sees what any torch optimizer sees

    def before_unscale(self, optimizer) -> None:
        """Whether any rank's gradients hold NaN or Inf, agreed before the scaler looks at this
        rank's, so that every rank's scaler skips the step (and backs off) alike."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.voter.agree_nonfinite(grads)

    def exchange(self, optimizer, params: list[torch.Tensor], name: str) -> Exchanged:
        refuse_dtensors(params, name)
        voter = self.voter
        world_size = voter.world_size
        if world_size > 1 and not optimizer.vote_in_step:
            raise RuntimeError(
                f"{name} on {world_size} ranks without its communication hook: under DDP call "
                "opt.register_comm_hook(ddp_model); without DDP pass vote_in_step=True"
            )
        if world_size > 1:
            voter.check_settings(optimizer.settings(), f"{name} settings")
            params = voter.used_on_any_rank(params, optimizer.steps_taken, name)
        else:
            params = [p for p in params if p.grad is not None]
        voted, averaged = optimizer.split_by_path(params)
        step = optimizer.steps_taken
        signs = voter.vote(
            [torch.zeros_like(p) if p.grad is None else p.grad for _, p, _ in voted],
            lambda i, grad: optimizer.local_direction(voted[i][1], grad),
            lambda i, ranks_per_node: optimizer.owner(voted[i][1], ranks_per_node),
            present=[p.grad is not None for _, p, _ in voted],
            step=step,
            label=f"{name} step {step}",
        )
        means = voter.mean([torch.zeros_like(p) if p.grad is None else p.grad for _, p, _ in averaged])
        return Exchanged(voted, signs, averaged, means)
