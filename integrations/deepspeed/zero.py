"""ZeRO-1 and ZeRO-2 with the vote between nodes: ZeRO inside each node, one bit between nodes.

The design is the FSDP2 node-aware route's (:func:`signmuon.optim.register_fsdp_vote`) with
DeepSpeed's flat partitions in place of FSDP's row shards. On N nodes of L ranks:

1. ZeRO partitions the optimizer state (and, at stage 2, the gradients) over the L ranks of
   each node, and reduce-scatters the gradients there in full precision: each rank holds its
   flat fp32 partition of its *node's* mean gradient.
2. DeepSpeed's step hands that partition to the base optimizer (ours, rebuilt on the
   partitions), which advances its momentum on it and votes its signs with the ranks of the
   same local rank on the other nodes (the *rail*), one bit per entry; so each node keeps one
   momentum between its L ranks, and the N nodes are the voters.
3. DeepSpeed all-gathers the updated parameters inside the node.

The seam: ``deepspeed.initialize(mpu=...)`` with :class:`NodePartitionMPU`. ZeRO takes its
partition group (``dp_process_group``) from the engine's sequence-data-parallel group, which an
mpu supplies (``get_sequence_data_parallel_group``), while the data-parallel world that batch
sizes and data samplers see stays all N x L ranks. It needs no patch of DeepSpeed's code and
no private attribute: every DeepSpeed code path that asks for the partition group gets the node
(reduction, norm, overflow check, checkpoint file names, start-up broadcast). The other seams
were worse: a group patched into the ZeRO optimizer after construction misses the buffers it
sized at construction; ``zero.Init(data_parallel_group=)`` is ZeRO-3 only. The price: the
sequence-parallel slot is ours, so real sequence parallelism (and any mpu of the user's:
tensor or pipeline parallelism) is refused.

What the integration adds around DeepSpeed's step (each agreed across every rank, not per node):

* a non-finite gradient anywhere skips the whole step on every rank (DeepSpeed's overflow
  check, its flag all-reduced over all ranks instead of the node), or raises ``NonFiniteError``
  on every rank with ``"vote": {"nonfinite": "raise"}``; the same all-reduce checks that every
  rank is at the same step (else ``VoteMismatchError`` on every rank, before any votes);
* the model is broadcast from rank 0 to every rank before DeepSpeed's in-node broadcast;
* checkpoints: DeepSpeed's own files come from node 0 only (every node would write the same
  names), and each rank keeps its momentum partition in its own file (``RANK_STATE_FILE``).

One node (N = 1): no vote is needed, none runs: ZeRO partitions over all ranks and each rank's
partition steps on the sign of the momentum of the mean gradient (Signum on one worker, the
node). One rank per node (L = 1): ZeRO partitions nothing and the rail is every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks import NonFiniteError, VoteConfig, VoteMismatchError
from signmuon.comm_hooks.dist import all_reduce, flatten, from_host, gather_rows, host_words, unflatten_into
from signmuon.comm_hooks.shard_vote import ShardVoter
from signmuon.comm_hooks.vote import NodeLayout

__all__ = ["NodePartitionMPU", "ZeroLayout", "check_zero_config", "zero_layout"]

ZERO_STAGES = (1, 2)


@dataclass(frozen=True, eq=False)
class ZeroLayout:
    """N nodes of L ranks, this rank's node group (ZeRO's partition group) and its rail."""

    nodes: int
    """N, the voters."""
    ranks_per_node: int
    """L, the ranks that share a node's partitions."""
    node_group: Any
    """This rank's node: ZeRO partitions and reduces here."""
    rail_group: Any
    """The ranks of this rank's local index, one per node: the vote runs here (this rank alone when N == 1)."""
    world_group: Any
    """Every rank (the data-parallel world DeepSpeed sees)."""

    def node_layout(self) -> NodeLayout:
        """The same as the vote's :class:`~signmuon.comm_hooks.vote.NodeLayout` (no node group when L == 1)."""
        world, rank, L = dist.get_world_size(), dist.get_rank(), self.ranks_per_node
        return NodeLayout(world, rank, L, self.nodes, self.node_group if L > 1 else None, self.rail_group)


def zero_layout(ranks_per_node: int | None) -> ZeroLayout:
    """Create the node and rail groups of N x L ranks (a collective: every rank calls it, in one
    order). ``ranks_per_node``: L; None reads torchrun's ``LOCAL_WORLD_SIZE``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "ZeRO with the vote between nodes needs the node size: launch with torchrun or deepspeed "
                '(which set LOCAL_WORLD_SIZE) or give "vote": {"ranks_per_node": L} in the config'
            )
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    # every rank decides on the same numbers
    sizes = gather_rows(torch.tensor([ranks_per_node]), None).reshape(-1).tolist()
    if len(set(sizes)) > 1 or sizes[0] < 1 or world % sizes[0]:
        raise ValueError(
            f"ranks per node {sorted(set(sizes))} (one value per rank) must be one number that divides the "
            f"world size {world}: nodes of different sizes cannot share ZeRO partitions rail by rail"
        )
    L = sizes[0]
    N = world // L
    node_group = rail_group = None
    for node in range(N):  # new_group is a collective over every rank: all create every group
        created = dist.new_group(list(range(node * L, (node + 1) * L)))
        if node == rank // L:
            node_group = created
    for local in range(L):
        created = dist.new_group(list(range(local, world, L)))  # one rank when N == 1: no vote
        if local == rank % L:
            rail_group = created
    return ZeroLayout(N, L, node_group, rail_group, dist.group.WORLD)


class NodePartitionMPU:
    """DeepSpeed's ``mpu`` protocol with no model parallelism, all ranks data parallel, and the
    node as the sequence-data-parallel group: the group ZeRO partitions and reduces over."""

    def __init__(self, layout: ZeroLayout) -> None:
        self.layout = layout

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        return None  # no model parallelism: DeepSpeed skips its model-parallel reductions

    def get_data_parallel_group(self):
        return self.layout.world_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_sequence_data_parallel_group(self):
        return self.layout.node_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.ranks_per_node

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank() % self.layout.ranks_per_node


def check_zero_config(config: dict[str, Any], name: str, kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming what to do for what ZeRO with the vote cannot run (on every rank:
    each rank checks the same config)."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        raise ValueError(
            f"optimizer {name} with ZeRO stage {stage}: stage 3 partitions the parameters over the partition "
            "group at construction (zero.Init), outside the node-aware seam, and its overflow check cannot be "
            'agreed between nodes. Use "zero_optimization": {"stage": 2} (gradients and optimizer state '
            "partitioned inside each node), or FSDP2 with signmuon.optim.register_fsdp_vote"
        )
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise ValueError(
                f'optimizer {name} with zero_optimization.{key}.device="{device}": CPU/NVMe offload runs '
                "DeepSpeed's own optimizer on the host, not the vote; remove the offload section"
            )
    zero_plus_plus = {k: zero.get(k) for k in ("zero_quantized_gradients", "zero_quantized_weights")}
    zero_plus_plus["zero_hpz_partition_size"] = zero.get("zero_hpz_partition_size", 1) != 1
    for key, used in zero_plus_plus.items():
        if used:
            raise ValueError(
                f"optimizer {name} with zero_optimization.{key}: ZeRO++ quantizes or re-partitions the traffic "
                "between nodes, which the one-bit vote replaces; remove it"
            )
    if config.get("sequence_parallel_size", 1) != 1:
        raise ValueError(
            f"optimizer {name} with sequence_parallel_size: the node-aware ZeRO uses DeepSpeed's "
            "sequence-data-parallel group for the node; train without sequence parallelism"
        )
    if (config.get("tensor_parallel") or {}).get("autotp_size", 1) not in (0, 1):
        raise ValueError(
            f"optimizer {name} with tensor_parallel.autotp_size: tensor parallelism in the same engine is not "
            "supported with the vote; give each rank the whole model"
        )
    if kwargs.get("mpu") is not None:
        raise ValueError(
            f"optimizer {name} with ZeRO and an mpu: the node-aware ZeRO supplies DeepSpeed's mpu itself (the node "
            "as the partition group), so tensor, pipeline and sequence parallelism cannot share the engine"
        )


def refuse_model(model: torch.nn.Module, name: str) -> None:
    """Pipeline modules and MoE layers (their own groups) cannot take the node-aware ZeRO."""
    kinds = {type(m).__name__ for m in model.modules()}
    for kind, what in (("PipelineModule", "pipeline parallelism"), ("MoE", "MoE (expert parallelism)")):
        if kind in kinds:
            raise ValueError(
                f"optimizer {name} with ZeRO and {what}: its process groups are outside the node-aware ZeRO; "
                "use a dense model without pipeline stages"
            )


def broadcast_model(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers (DeepSpeed broadcasts inside the node only)."""
    tensors = [t.data for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    for dtype in sorted({t.dtype for t in tensors}, key=str):  # one all-reduce per dtype
        same = [t for t in tensors if t.dtype == dtype]
        flat = flatten(same)
        if dist.get_rank() != 0:
            flat.zero_()  # the sum is then rank 0's values, exactly
        unflatten_into(all_reduce(flat, None), same)


def agree_step(zero_optimizer, optimizer, voter: ShardVoter, vote: VoteConfig) -> None:
    """Make ZeRO's overflow check, all-reduced over every rank, also the check that every rank is
    at the same step, and the settling of ``voter``'s deferred mismatches: one all-reduce, read once.

    Ranks out of step raise ``VoteMismatchError`` on every rank before any votes (a rail would
    refuse them, and the node's other rails wait for it in DeepSpeed's all-gather). A mismatch the
    voter deferred all the same (its rail idle, so no rank hangs) raises here, at the next step. A
    NaN or Inf in any rank's partition skips the step everywhere (counted in ``optimizer.stats.skipped``),
    or raises ``NonFiniteError`` on every rank with ``nonfinite="raise"``."""
    local = zero_optimizer.has_overflow_partitioned_grads_serial

    def has_overflow(partition_gradients=True) -> bool:
        step = optimizer.steps_taken
        words = torch.cat([voter.pending_flag(), from_host([step, -step], torch.int64, voter.device)])
        words = torch.cat([local().to(words.device, torch.int64).reshape(1), words])  # the flag stays on the device
        all_reduce(words, None, op="max")
        overflow, pending, highest, lowest = host_words(words)  # the one read of the step
        voter.raise_agreed(bool(pending))  # first: a rail that raised may have stopped short of counting its step
        if highest != -lowest:
            raise VoteMismatchError(
                f"ranks entered the optimizer step at different steps (from {-lowest} to {highest}) and "
                "raised VoteMismatchError: no rank steps; resume every rank from the same checkpoint"
            )
        if not overflow:
            return False
        if vote.nonfinite == "raise":
            raise NonFiniteError("NaN or Inf in a node's mean gradient: no rank steps (nonfinite='raise')")
        optimizer.stats.skipped += 1
        return True

    zero_optimizer.has_overflow = has_overflow
    zero_optimizer.check_grad_overflow = True  # fp32 and bf16 too: a skip must be every rank's


def defer_mismatch(optimizer, voter: ShardVoter) -> None:
    """Let a rail's ``VoteMismatchError`` in ``optimizer.step`` wait for :func:`agree_step`: the
    step does nothing on that rail, and DeepSpeed's all-gather in the node, where the node's other
    rails wait, goes on."""
    step = optimizer.step

    def deferring_step(*args, **kwargs):
        with voter.deferring():
            return step(*args, **kwargs)
        return None

    optimizer.step = deferring_step
