"""What ``ddp-step`` builds for each method on one rank: the model (DDP-wrapped, or sharded by
FSDP2), its optimizer and hook, and what counts the bytes. Each builder takes ``(args, device)``
(the command's options: ``width``, ``depth``, ``ranks_per_node``, ``vote_zeros``) and returns a
:class:`StepSetup`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.benchmarks.methods.training import counted_powersgd_hook, shard_blocks
from signmuon.benchmarks.workloads.models import mlp
from signmuon.comm_hooks import CommStats, SignVoteState, VoteConfig, sign_vote_hook
from signmuon.optim import SignMuon, node_mesh, register_fsdp_vote

__all__ = ["StepSetup", "allreduce", "fp16_allreduce", "fsdp", "powersgd", "sign_muon", "sign_vote"]


@dataclasses.dataclass
class StepSetup:
    """One method's step on one rank."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    state: object | None = None
    """What counts the bytes (``.stats``), or None: the all-reduce's ring formula."""
    bytes_per_entry: int = 4
    """Without ``state``: the all-reduced gradient's bytes per entry."""
    shard_ranks: int | None = None
    """FSDP2: the ranks it shards over (its own collectives' bytes come by formula)."""
    node_layout: Callable[[], tuple[int, int, object]] | None = None
    """Node-aware: (nodes, ranks per node, the node's group), for the bytes between nodes."""


def _ddp(args, device: torch.device) -> DDP:
    net = mlp(args.width, args.depth).to(device)
    return DDP(net, device_ids=[device.index] if device.type == "cuda" else None)


def _vote(args, node_aware: bool) -> VoteConfig:
    node = dict(hierarchical=True, ranks_per_node=args.ranks_per_node) if node_aware else {}
    return VoteConfig(zeros=args.vote_zeros, **node)


def allreduce(args, device: torch.device) -> StepSetup:
    """DDP's own fp32 all-reduce (no hook), SGD."""
    model = _ddp(args, device)
    return StepSetup(model, torch.optim.SGD(model.parameters(), lr=1e-3))


def fp16_allreduce(args, device: torch.device) -> StepSetup:
    """torch's fp16 compression hook, SGD."""
    model = _ddp(args, device)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return StepSetup(model, torch.optim.SGD(model.parameters(), lr=1e-3), bytes_per_entry=2)


def powersgd(rank: int) -> Callable[..., StepSetup]:
    """torch's PowerSGD hook of rank ``rank`` (counted; one bucket at a time on gloo), SGD."""

    def build(args, device: torch.device) -> StepSetup:
        model = _ddp(args, device)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        stats = CommStats()  # ring bytes of P and Q, counted by the hook
        model.register_comm_hook(state, counted_powersgd_hook(rank, stats))
        return StepSetup(model, torch.optim.SGD(model.parameters(), lr=1e-3), SimpleNamespace(stats=stats))

    return build


def _node_layout(state) -> Callable[[], tuple[int, int, object]]:
    return lambda: (state.layout.nodes, state.layout.ranks_per_node, state.layout.node_group)


def sign_vote(momentum: float, node_aware: bool = False) -> Callable[..., StepSetup]:
    """The sign-vote hook (signSGD-MV at momentum 0, else Signum-MV), SGD applying the vote."""

    def build(args, device: torch.device) -> StepSetup:
        model = _ddp(args, device)
        vote = _vote(args, node_aware)
        state = SignVoteState(process_group=None, start_iter=1, momentum=momentum, vote=vote)
        model.register_comm_hook(state, sign_vote_hook)
        layout = _node_layout(state) if node_aware else None
        return StepSetup(model, torch.optim.SGD(model.parameters(), lr=1e-3), state, node_layout=layout)

    return build


def sign_muon(node_aware: bool = False) -> Callable[..., StepSetup]:
    """SignMuon with its own hook."""

    def build(args, device: torch.device) -> StepSetup:
        model = _ddp(args, device)
        opt = SignMuon(model.parameters(), lr=1e-3, vote=_vote(args, node_aware))
        state = opt.register_comm_hook(model)
        return StepSetup(model, opt, state, node_layout=_node_layout(state) if node_aware else None)

    return build


def fsdp(optimizer: type | None, *, during_backward: bool = True) -> Callable[..., StepSetup]:
    """FSDP2 per block: over every rank with SGD with momentum (``optimizer`` None, the fp32
    reduce-scatter), or inside each node with ``optimizer`` voting between nodes (unit by unit
    during backward, or in ``step()``)."""

    def build(args, device: torch.device) -> StepSetup:
        from torch.distributed.device_mesh import init_device_mesh

        net = mlp(args.width, args.depth).to(device)
        if optimizer is None:
            world_size = dist.get_world_size()
            shard_blocks(net, init_device_mesh(device.type, (world_size,)))
            return StepSetup(net, torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9), shard_ranks=world_size)
        mesh = node_mesh(args.ranks_per_node, device_type=device.type)
        shard_blocks(net, mesh["local"])
        opt = optimizer(net.parameters(), lr=1e-3, vote=VoteConfig(zeros=args.vote_zeros))
        exchange = register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
        nodes, per_node = exchange.mesh_shape
        return StepSetup(
            net, opt, opt, shard_ranks=per_node, node_layout=lambda: (nodes, per_node, exchange.voter.layout.node_group)
        )

    return build
