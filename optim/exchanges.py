"""Where a sign-vote optimizer's ``step()`` gets its voted signs and mean gradients, for
unsharded parameters: from the DDP hook (or the backward reducer), which ran the pre-vote half
and the vote during backward, or voted in ``step()`` itself (one process, ``vote_in_step``).
The FSDP2 path is :meth:`~signmuon.optim.fsdp.ShardedVote.exchange`. Each returns
``(voted, signs, averaged, means)``: (group, param, path) of the voted and the averaged
parameters, and the update of each."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from signmuon.comm_hooks import SignMuonHookState
from signmuon.comm_hooks.step_vote import StepVoter

__all__ = ["from_hook", "in_step", "refuse_dtensors"]


def refuse_dtensors(params: list[torch.Tensor], name: str) -> None:
    """DTensor (FSDP2) parameters need the FSDP vote; say so instead of failing in a kernel."""
    if any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            f"{name} has DTensor parameters (a model sharded by FSDP2's fully_shard) but no FSDP vote: call "
            "signmuon.optim.register_fsdp_vote(model, optimizer, mesh) with the (node, local) mesh of "
            "signmuon.optim.node_mesh(), and shard over mesh['local']; the DDP hook and vote_in_step vote whole tensors"
        )


def from_hook(
    optimizer, state: SignMuonHookState, params: list[torch.Tensor], name: str
) -> tuple[list, list, list, list]:
    """The hook left the vote in ``.grad`` (and the mean of averaged parameters): its sign undoes
    any rescaling since (clipping), taken in place (a fresh tensor per parameter per step costs
    more than the sign itself)."""
    state.check_one_pass(name)
    voted, averaged = optimizer.split_by_path([p for p in params if p.grad is not None])
    return voted, [p.grad.sign_() for _, p, _ in voted], averaged, [p.grad for _, p, _ in averaged]


def in_step(optimizer, voter: StepVoter, params: list[torch.Tensor], name: str) -> tuple[list, list, list, list]:
    """Vote in ``step()`` across ``voter``'s group (alone: the local signs)."""
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
    return voted, signs, averaged, means
