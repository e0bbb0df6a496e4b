"""Local SGD's wiring into DDP: gradients all-reduced during the warm-up, then kept on each
worker (or inside each node), with an averager called after every optimizer step."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

__all__ = ["local_sgd", "register_local_sgd_hook"]


_PER_RANK = (
    "torch.distributed.checkpoint.state_dict keeps only the inner optimizer's state (not the averager's), and DCP "
    "keeps one copy of what every rank saves under one name while local-step workers differ between rounds: save "
    "each rank's model.state_dict() and this optimizer's state_dict() with torch.save, one file per rank"
)


class _RoundsOptimizer(PostLocalSGDOptimizer):
    """``PostLocalSGDOptimizer`` whose state dict holds the whole averager, not its step alone:
    a run resumed from it alone gets the consensus and outer momentum back too."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:  # get_state_dict's step(closure=None), which would also step the averager
            raise ValueError(f"local_sgd's optimizer takes no closure: {_PER_RANK}")
        super().step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if hasattr(self.averager, "state_dict"):
            state["averager"] = self.averager.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "averager" not in state_dict and "step" not in state_dict:
            raise ValueError(f"local_sgd's optimizer state without the averager's step or state: {_PER_RANK}")
        if "averager" not in state_dict or not hasattr(self.averager, "load_state_dict"):
            super().load_state_dict(state_dict)  # torch's: the step alone
            return
        self.optim.load_state_dict({k: v for k, v in state_dict.items() if k not in ("averager", "step")})
        self.averager.load_state_dict(state_dict["averager"])


def local_sgd(
    ddp_model: nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    averager: ModelAverager,
) -> PostLocalSGDOptimizer:
    """Set up local SGD: all-reduce gradients for ``averager.warmup_steps``, then none at all.

    Registers :func:`register_local_sgd_hook`'s hook and wraps ``optimizer`` in a
    ``PostLocalSGDOptimizer(optimizer, averager)`` whose ``state_dict`` also holds the
    averager's (its step, and with an outer step the consensus): save and load it to resume.
    Load each rank's model state after building DDP, whose constructor copies rank 0's
    parameters to every rank. All ranks must call it.
    """
    register_local_sgd_hook(ddp_model, averager)
    return _RoundsOptimizer(optimizer, averager)


@dataclasses.dataclass
class _LocalSGDState:
    averager: ModelAverager
    node_group: dist.ProcessGroup | None  # node-aware rounds: gradients all-reduced inside the node


def _local_sgd_hook(state: _LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # The averager's step decides, not a counter of the hook's own (torch's post_localSGD_hook
    # counts from 0 in every process, so a run resumed past the warm-up all-reduced warmup_steps
    # steps more), and it counts optimizer steps, not backward passes.
    averager = state.averager
    if averager.step < averager.warmup_steps:
        return allreduce_hook(averager.process_group, bucket)
    if state.node_group is not None:
        return allreduce_hook(state.node_group, bucket)
    kept: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    kept.set_result(bucket.buffer())
    return kept


def register_local_sgd_hook(ddp_model: nn.parallel.DistributedDataParallel, averager: ModelAverager) -> None:
    """The communication half of :func:`local_sgd`: gradients all-reduced (over the averager's
    process group) while ``averager.step < averager.warmup_steps``, then none leaves its worker
    (for frameworks that call ``averager.average_parameters`` after each optimizer step
    themselves); with node-aware rounds (an averager with ``layout``) they are all-reduced inside
    each node every step. The averager's step decides, so a resumed run (its step restored)
    resumes after the warm-up. All ranks call it."""
    layout = getattr(averager, "layout", None)
    state = _LocalSGDState(averager, layout.node_group if layout is not None else None)
    ddp_model.register_comm_hook(state, _local_sgd_hook)
