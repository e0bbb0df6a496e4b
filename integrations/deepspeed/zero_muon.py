"""SignMuon on ZeRO-1/2's flat partitions: every matrix to its owner for Newton–Schulz, the vote
between nodes, each rank's piece back.

ZeRO lays a param group out in one flat buffer and cuts it into L equal partitions, one per rank
of the node, wherever the cuts fall: a matrix may be split between partitions, mid-row too. The
optimizer is built on the model's parameters, whose whole shapes route them (matrices to
Newton–Schulz, the rest to ``non_matrix``), with each parameter's state and update on this
rank's piece of it, a view of the rank's fp32 partition (:meth:`ZeroExchange.local_part`): a
rank holds 1/L of its node's momentum. Each step is the FSDP route's vote
(:func:`~signmuon.optim.shards.vote_shards`) on element ranges instead of row shards:

1. the momentum advances on each piece of the node-mean gradient ZeRO reduced into the partition;
2. each matrix's pieces go to its owner in one all-to-all inside the node (the FSDP route's owner
   rule, :func:`~signmuon.optim.shards.shard_specs`: largest Newton–Schulz cost first, to the
   least loaded local rank), which orthogonalises the whole matrix;
3. every rank votes on its rail, one bit per entry between nodes: its pieces of the other
   parameters and the whole matrices it owns;
4. each rank gets its piece of every voted matrix back, one all-to-all inside the node.

DeepSpeed's ZeRO optimizer holds :class:`PartitionStep` as its base optimizer: it has the shape
DeepSpeed expects (one flat partition per group, state keyed by it) and steps ours.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks.dist import check_same_settings
from signmuon.comm_hooks.shard_vote import ShardVoter
from signmuon.comm_hooks.vote import VoteConfig
from signmuon.optim import sign_optimizer_from_spec
from signmuon.optim.exchanges import Exchange, Exchanged
from signmuon.optim.shards import shard_specs, vote_shards
from signmuon.optim.sign_vote import SignVoteOptimizer

from .zero import ZeroLayout

__all__ = ["PartitionLayout", "PartitionStep", "ZeroExchange", "partition_layout", "sign_muon_on_partitions"]

_LAYOUT = ("round_robin_bit16_groups", "round_robin_bit16_offsets", "parallel_partitioned_bit16_groups")


@dataclass(frozen=True, eq=False)
class PartitionLayout:
    """Where each parameter of ZeRO's param group lies in the node's L partitions."""

    ranges: dict[torch.Tensor, tuple[tuple[int, int], ...]]
    """Per parameter, its element range in each local rank's partition, in rank order (empty where
    a partition holds none of it): a :class:`~signmuon.comm_hooks.shard_vote.ShardSpec`'s ``ranges``."""
    offsets: dict[torch.Tensor, int]
    """Where each parameter starts in the group's flat buffer."""
    starts: tuple[int, ...]
    """Where each local rank's partition starts in it."""

    def piece(self, param: torch.Tensor, local_rank: int) -> tuple[int, int]:
        """(start in ``local_rank``'s partition, entries) of its piece of ``param`` ((0, 0): none)."""
        lo, hi = self.ranges[param][local_rank]
        return (self.offsets[param] + lo - self.starts[local_rank], hi - lo) if hi > lo else (0, 0)


def partition_layout(zero_optimizer) -> PartitionLayout:
    """The layout of ZeRO's one param group: DeepSpeed flattens its parameters in
    ``round_robin_bit16_groups`` order at ``round_robin_bit16_offsets`` (alignment padding
    between them) and cuts the buffer into the consecutive ``parallel_partitioned_bit16_groups``."""
    if not all(hasattr(zero_optimizer, name) for name in _LAYOUT):
        raise RuntimeError(
            f"this DeepSpeed's ZeRO optimizer ({type(zero_optimizer).__name__}) does not say where each parameter "
            f"lies in its partitions ({', '.join(_LAYOUT)}), which SignMuon on ZeRO needs; use SignumMV with ZeRO, "
            'or "zero_optimization": {"stage": 0} for SignMuon'
        )
    (params,) = zero_optimizer.round_robin_bit16_groups
    (offsets,) = zero_optimizer.round_robin_bit16_offsets
    (partitions,) = zero_optimizer.parallel_partitioned_bit16_groups
    sizes = [t.numel() for t in partitions]
    starts = tuple(sum(sizes[:r]) for r in range(len(sizes)))
    ranges = {}
    for p, offset in zip(params, offsets):
        n = p.numel()
        ranges[p] = tuple(
            (min(max(s - offset, 0), n), min(max(s + size - offset, 0), n)) for s, size in zip(starts, sizes)
        )
    return PartitionLayout(ranges, dict(zip(params, offsets)), starts)


class ZeroExchange(Exchange):
    """How a sign-vote optimizer on the model's parameters votes this rank's ZeRO partition.

    Args:
        partition: this rank's flat fp32 partition (DeepSpeed's master weights; ZeRO puts the
            node-mean gradient in its ``.grad`` before the step).
        layout: :func:`partition_layout`.
        nodes: the nodes and their groups.
    """

    finishes_vote = True

    def __init__(self, partition: torch.Tensor, layout: PartitionLayout, nodes: ZeroLayout) -> None:
        rank, L = dist.get_rank(), nodes.ranks_per_node
        self.partition, self.layout, self.ranks_per_node = partition, layout, L
        self.pieces = {p: layout.piece(p, rank % L) for p in layout.ranges}
        self.node_layout = nodes.node_layout()
        self.voter: ShardVoter | None = None
        """The vote's communication (made once the optimizer serves: it counts into its stats)."""
        self.specs: dict = {}

    def local_part(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``param``: a view of its fp32 partition (possibly empty)."""
        if param not in self.pieces:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} is not in ZeRO's param group: the optimizer on ZeRO "
                "partitions takes the parameters DeepSpeed partitions, all of them"
            )
        return self.partition.narrow(0, *self.pieces[param])

    def check_serves(self, optimizer: SignVoteOptimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len(params) != len(self.pieces) or set(params) != set(self.pieces):
            raise ValueError("the optimizer on ZeRO partitions must hold exactly the parameters DeepSpeed partitions")
        # a rail's mismatch waits for the next step's agreement (.zero.agree_step): the node's other
        # rails meet this rail in the all-to-alls first
        self.voter = ShardVoter(self.node_layout, optimizer.vote_config, optimizer.stats, defer_mismatch=True)
        self.specs = shard_specs(optimizer, self.ranks_per_node, self.layout.ranges)

    def params_changed(self, optimizer: SignVoteOptimizer) -> None:
        if self.voter is not None:
            raise ValueError("ZeRO partitions its param groups once, at deepspeed.initialize: add no param group later")

    def exchange(self, optimizer: SignVoteOptimizer, params: list[torch.Tensor], name: str) -> Exchanged:
        """This rank's pieces of the voted updates (the polar step applied at each matrix's owner)
        and of the mean gradients, from the node-mean gradient ZeRO left in the partition."""
        grad = self.partition.grad
        if grad is None:
            raise RuntimeError(
                f"{name}.step() on ZeRO partitions without a gradient in the partition: step through the DeepSpeed "
                "engine (engine.step()), which reduces the gradients into it first"
            )
        grads = [grad.narrow(0, *self.pieces[p]) for p in params]
        step = optimizer.steps_taken
        return vote_shards(optimizer, self.voter, params, grads, self.specs, label=f"{name} step {step}", mean_tag=step)


class PartitionStep:
    """DeepSpeed's base optimizer under ZeRO for an optimizer on the model's parameters: DeepSpeed's
    param group (its flat fp32 partition), and a state DeepSpeed may key by that partition (it
    links its fragments to the base optimizer's state); ``step()`` copies the group's ``lr``
    (which DeepSpeed's schedulers set) into ``optimizer``'s group and steps it."""

    def __init__(self, param_groups: list[dict[str, Any]], optimizer: SignVoteOptimizer) -> None:
        self.param_groups, self.optimizer = param_groups, optimizer
        self.defaults = optimizer.defaults
        self.state: defaultdict = defaultdict(dict)

    @property
    def stats(self):
        """``optimizer``'s byte counters."""
        return self.optimizer.stats

    def step(self, closure=None):
        for ours, theirs in zip(self.optimizer.param_groups, self.param_groups):
            ours["lr"] = theirs["lr"]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def sign_muon_on_partitions(
    zero_optimizer, spec: dict[str, Any], group: dict[str, Any], nodes: ZeroLayout, vote: VoteConfig, reserved
) -> tuple[SignVoteOptimizer, PartitionStep]:
    """``spec``'s optimizer (SignMuon) on the parameters of ZeRO's one param group, voting its
    partitions, and the base optimizer for DeepSpeed; ``group``: the group's settings (a
    collective: every rank checks that every rank has the same)."""
    (partition,) = zero_optimizer.single_partition_of_fp32_groups
    (params,) = zero_optimizer.bit16_groups
    exchange = ZeroExchange(partition, partition_layout(zero_optimizer), nodes)
    optimizer = sign_optimizer_from_spec(
        spec,
        [{**group, "params": list(params)}],
        reserved=reserved,
        vote=vote,
        process_group=nodes.rail_group,
        checkpoint_all_ranks=False,
        exchange=exchange,
    )
    name = type(optimizer).__name__
    check_same_settings(optimizer.settings(), None, what=f"{name} settings on ZeRO partitions")
    return optimizer, PartitionStep(zero_optimizer.optimizer.param_groups, optimizer)
