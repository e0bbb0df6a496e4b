"""Local SGD's wiring into DDP: gradients all-reduced during the warm-up, then kept on each
worker (or inside each node), with an averager called after every optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

__all__ = ["local_sgd", "register_local_sgd_hook"]


def local_sgd(
    ddp_model: nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    averager: ModelAverager,
) -> torch.distributed.optim.PostLocalSGDOptimizer:
    """Set up local SGD: all-reduce gradients for ``averager.warmup_steps``, then none at all.

    Registers torch's ``post_localSGD_hook`` with one-rank subgroups (so after the warm-up
    no gradient leaves its worker; torch's default subgroup is the whole node) and wraps
    ``optimizer`` in ``PostLocalSGDOptimizer(optimizer, averager)``, whose ``state_dict``
    also records the averager's step. All ranks must call it (it creates subgroups).
    """
    from torch.distributed.optim import PostLocalSGDOptimizer

    register_local_sgd_hook(ddp_model, averager)
    return PostLocalSGDOptimizer(optimizer, averager)


def register_local_sgd_hook(ddp_model: nn.parallel.DistributedDataParallel, averager: ModelAverager) -> None:
    """The communication half of :func:`local_sgd`: gradients all-reduced for
    ``averager.warmup_steps`` steps, then none leaves its worker (for frameworks that call
    ``averager.average_parameters`` after each optimizer step themselves); with node-aware rounds
    (an averager with ``layout``) they are all-reduced inside each node every step. All ranks call it."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    layout = getattr(averager, "layout", None)
    if layout is not None:
        subgroup = layout.node_group
    else:
        subgroup, _ = dist.new_subgroups(group_size=1)
    state = PostLocalSGDState(
        process_group=averager.process_group, subgroup=subgroup, start_localSGD_iter=averager.warmup_steps
    )
    ddp_model.register_comm_hook(state, post_localSGD_hook)
