"""torchtitan: the sign-vote optimizers in its ``OptimizersContainer``, voting between nodes.

torchtitan 0.3.0 resolves optimizer names to Adam, AdamW and DistMuon only
(``OptimizersContainer._resolve_optimizer_factory``). Its route for others is an experiment
whose optimizer config subclasses ``OptimizersContainer.Config``, as torchtitan's own
``TorchFTOptimizersContainer`` does. :class:`SignVoteOptimizersContainer` is that subclass: it
resolves ``"SignMuon"``, ``"SignumMV"`` and ``"SignSGDMV"`` and registers the FSDP vote on each
model part (each FSDP unit's all-reduce hook votes during backward, in the place torchtitan's
torchft experiment puts its replica all-reduce)::

    from torchtitan.components.optimizer import ParamGroupConfig
    from signmuon.comm_hooks import VoteConfig
    from signmuon.integrations.torchtitan import SignVoteOptimizersContainer
    from signmuon.optim import node_mesh

    mesh = node_mesh()                                   # shard with fully_shard(..., mesh=mesh["local"])
    config = SignVoteOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="SignMuon",
                                       optimizer_kwargs={"lr": 2e-3, "non_matrix": "adamw"})],
        optimizer_factory_kwargs_by_name={"SignMuon": {"vote": VoteConfig(zeros="coin")}},
    )
    optimizers = config.build(model_parts=model_parts, mesh=mesh)

Every parameter group must name one of ours: a group on AdamW would keep its gradients inside
the node (SignMuon's ``non_matrix="adamw"`` path averages them between nodes instead).
``optimizer_kwargs`` are param-group settings; the optimizer's own arguments (``vote``,
``master_weights``...) go in ``optimizer_factory_kwargs_by_name``, and are refused in a group
(where torch's optimizers would keep them without effect).

Needs ``pip install 'signmuon[torchtitan]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "signmuon.integrations.torchtitan needs torchtitan: pip install 'signmuon[torchtitan]'"
    ) from error

import torch
from torch.distributed.device_mesh import DeviceMesh

from signmuon.optim import SIGN_OPTIMIZERS, register_fsdp_vote

__all__ = ["SIGN_VOTE_OPTIMIZERS", "SignVoteOptimizersContainer"]

SIGN_VOTE_OPTIMIZERS: dict[str, type] = {cls.__name__: cls for cls in SIGN_OPTIMIZERS.values()}
"""The optimizer names the container resolves, beside torchtitan's own (our optimizers by class name)."""
_OPTIMIZER_ARGUMENTS = ("vote", "process_group", "vote_in_step", "checkpoint_all_ranks", "master_weights")


class SignVoteOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose optimizers vote between nodes on FSDP2 shards.

    Args:
        config: the param groups (each naming one of :data:`SIGN_VOTE_OPTIMIZERS`).
        model_parts: the model parts, each sharded with ``fully_shard(..., mesh=mesh["local"])``.
        mesh: the (node, local) mesh of :func:`~signmuon.optim.node_mesh`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        implementation: str = "for-loop"
        """Ours have no fused or foreach kernels; the only value accepted."""
        during_backward: bool = True
        """Vote each FSDP unit as backward reduces it (False: in ``step()``; the same result)."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module], mesh: DeviceMesh) -> None:
        if config.implementation != "for-loop":
            raise ValueError(f"implementation={config.implementation!r}: the sign-vote optimizers run 'for-loop' only")
        others = sorted({g.optimizer_name for g in config.param_groups} - set(SIGN_VOTE_OPTIMIZERS))
        if others:
            raise ValueError(
                f"param groups on {others}: every group must use one of {sorted(SIGN_VOTE_OPTIMIZERS)}, or its "
                "gradients would never cross nodes (SignMuon(non_matrix='adamw') takes AdamW's parameters)"
            )
        for group in config.param_groups:
            misplaced = sorted(set(group.optimizer_kwargs) & set(_OPTIMIZER_ARGUMENTS))
            if misplaced:
                raise ValueError(
                    f"param group {group.pattern!r}: {misplaced} are arguments of the optimizer, not of a param group; "
                    f"pass them as optimizer_factory_kwargs_by_name={{{group.optimizer_name!r}: {{...}}}}"
                )
        super().__init__(config, model_parts=model_parts)
        per_part = len(self.optimizers) // len(model_parts)
        for index, optimizer in enumerate(self.optimizers):
            register_fsdp_vote(model_parts[index // per_part], optimizer, mesh, during_backward=config.during_backward)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in SIGN_VOTE_OPTIMIZERS:
            return SIGN_VOTE_OPTIMIZERS[name]
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_impl_kwargs(config: Any) -> dict[str, Any]:
        return {}  # no fused/foreach entries in our param groups
