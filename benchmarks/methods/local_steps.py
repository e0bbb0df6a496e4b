"""What ``train`` builds for the local-step methods: local SGD and DPPF, the rounds with an
outer step (DiLoCo, MuLoCo, one-bit rounds; node-aware where the run is laid out in nodes) and
their FSDP2 form."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from signmuon.benchmarks.methods.hooks import fsdp_traffic, shard_blocks
from signmuon.benchmarks.methods.training import Builder, Setup, TrainConfig, ddp
from signmuon.comm_hooks import node_layout
from signmuon.optim import LocalStepAverager, MuonWithAdamW, OuterStep, local_sgd, muon_param_groups, node_mesh

__all__ = ["LOCAL_SGD_PULL_PUSH", "adamw", "muon_adamw", "outer_step", "periodic", "rounds", "sharded_rounds"]


def outer_step(config: TrainConfig, pseudo_gradient: str) -> OuterStep:
    """The DiLoCo methods' outer step: Nesterov SGD (plain SGD at momentum 0) at the run's settings;
    the scale settings go to the methods whose rule has scales (so one run can compare rules)."""
    scaled = pseudo_gradient in OuterStep.SCALED
    return OuterStep(
        optimizer=functools.partial(
            torch.optim.SGD, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_momentum > 0
        ),
        pseudo_gradient=pseudo_gradient,
        scale_block=config.outer_scale_block if scaled else 0,
        scale_bits=config.outer_scale_bits if scaled else 32,
    )


def sharded_rounds(period: int, pseudo_gradient: str = "mean") -> Builder:
    """AdamW on a model sharded over each node by FSDP2 (its reduce-scatter every step), and
    DiLoCo's rounds between nodes on each rank's shard, over its rail."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        device = next(net.parameters()).device
        mesh = node_mesh(config.ranks_per_node, device_type=device.type)
        shard_blocks(net, mesh["local"])
        opt = adamw(net.parameters(), config.lr_scale)
        averager = LocalStepAverager(
            period,
            pull=1.0,
            outer=outer_step(config, pseudo_gradient),
            module=net,
            process_group=mesh["node"].get_group(),
        )
        per_step = fsdp_traffic(sum(p.numel() for p in net.parameters()), mesh.shape[1])

        def after_step(*_) -> None:
            averager.stats.add(per_step, per_step, inside_node=True)
            averager.average_parameters(net.parameters())

        opt.register_step_post_hook(after_step)
        return Setup(model=net, optimizer=opt, stats=averager.stats, averager=averager)

    return build


LOCAL_SGD_PULL_PUSH = (1.0, 0.0)  # (pull, push) of plain periodic averaging


def periodic(period: int, pull: float = 1.0, push: float = 0.0) -> Builder:
    """Local SGD with momentum; pull=1, push=0 is plain periodic averaging, else DPPF."""

    is_dppf = (pull, push) != LOCAL_SGD_PULL_PUSH

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = ddp(net)
        pull_push = config.pull_push if is_dppf and config.pull_push is not None else (pull, push)
        averager = LocalStepAverager(period, pull=pull_push[0], push=pull_push[1], module=net)
        opt = local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.05 * config.lr_scale, momentum=0.9), averager)
        return Setup(model=model, optimizer=opt, stats=averager.stats, averager=averager)

    return build


def adamw(params, lr_scale: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3 * lr_scale)


def muon_adamw(params, lr_scale: float) -> torch.optim.Optimizer:
    return MuonWithAdamW(params, lr=0.02 * lr_scale, adamw_lr=2e-3 * lr_scale)


def rounds(
    period: int,
    pseudo_gradient: str | None = "mean",
    pull: float = 1.0,
    push: float = 0.0,
    inner=adamw,
    fragments: int = 1,
    sync_delay: int = 0,
) -> Builder:
    """``inner`` (AdamW; or torch's Muon with AdamW, MuLoCo) on each worker, a round every
    ``period`` steps: DiLoCo's outer Nesterov step on the pseudo-gradients combined by
    ``pseudo_gradient`` (None: plain averaging, no outer step). Node-aware where the run is laid
    out in nodes (``--ranks-per-node``, torchrun): the inner step on the node's mean gradient
    every step, rounds between nodes on the rails. ``fragments`` > 1 streams them (Streaming
    DiLoCo): each fragment's round every ``period`` steps at staggered offsets, issued
    ``sync_delay`` steps before it lands."""

    is_dppf = (pull, push) != LOCAL_SGD_PULL_PUSH

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = ddp(net)
        layout = node_layout(None, config.ranks_per_node) if dist.get_world_size() > 1 else None
        layout = layout if layout is not None and layout.nodes > 1 else None
        pull_push = config.pull_push if is_dppf and config.pull_push is not None else (pull, push)
        outer = None if pseudo_gradient is None else outer_step(config, pseudo_gradient)
        averager = LocalStepAverager(
            period,
            pull=pull_push[0],
            push=pull_push[1],
            module=net,
            outer=outer,
            layout=layout,
            fragments=fragments,
            sync_delay=sync_delay,
        )
        params = muon_param_groups(net) if inner is muon_adamw else model.parameters()
        opt = local_sgd(model, inner(params, config.lr_scale), averager)
        return Setup(model=model, optimizer=opt, stats=averager.stats, averager=averager)

    return build
