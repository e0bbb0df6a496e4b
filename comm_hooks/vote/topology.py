"""Which ranks share a node: the groups of the node-aware vote.

With M = N·L ranks on N nodes of L ranks each (node-contiguous: rank r is local rank r mod L
of node r div L, as torchrun numbers them), the node-aware vote uses two kinds of subgroup:

* the *node* group of each node (its L ranks, joined by NVLink or shared memory), where
  gradients travel in full precision;
* the *rail* of each local index l (the N ranks with local rank l, one per node), where the
  signs travel at one bit per entry. Each rank's NIC carries its own rail, so a node's links
  share the between-node bytes.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dist import gather_rows, group_device, group_size_rank

__all__ = ["NodeLayout", "node_layout"]


@dataclass(frozen=True, eq=False)
class NodeLayout:
    """This rank's place among N nodes of L ranks, with its node group and its rail group."""

    world_size: int
    rank: int
    ranks_per_node: int  # L
    nodes: int  # N
    node_group: dist.ProcessGroup | None  # this rank's node (None when L == 1: nothing to reduce)
    rail_group: dist.ProcessGroup | None  # ranks with this rank's local index, one per node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def flat(self) -> bool:
        """One node, or one rank per node: the node-aware vote is the flat vote."""
        return self.nodes == 1 or self.ranks_per_node == 1


def _node_identity() -> int:
    """torchrun's node rank (GROUP_RANK) where set, else a hash of the host name."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "little")


def node_layout(group: dist.ProcessGroup | None, ranks_per_node: int | None) -> NodeLayout:
    """Build the node and rail groups of ``group``; a collective: call it on every rank of ``group``.

    ``ranks_per_node`` states L; ``None`` reads it from torchrun's ``LOCAL_WORLD_SIZE`` and then
    checks what torchrun says about each rank (``GROUP_RANK``/host name and ``LOCAL_RANK``): a
    layout that is not node-contiguous, or nodes of different sizes, raise ``ValueError`` on
    every rank, naming the ranks.
    """
    world_size, rank = group_size_rank(group)
    if world_size != group_size_rank(None)[0]:
        raise ValueError(
            f"the node-aware vote needs its process group to span every rank ({world_size} of "
            f"{group_size_rank(None)[0]}): its node and rail groups are made with new_group, which all ranks must call"
        )
    stated = ranks_per_node is not None
    if ranks_per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "the node-aware vote needs the node size: run under torchrun (which sets LOCAL_WORLD_SIZE) "
                "or pass VoteConfig(ranks_per_node=L)"
            )
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(ranks_per_node, 1)))
    device = group_device(group)
    identity = _node_identity() if not stated else rank // max(ranks_per_node, 1)
    row = torch.tensor([ranks_per_node, identity, local_rank], device=device)
    rows = gather_rows(row, group).tolist()  # [M, 3]: the same on every rank, so all decide alike
    sizes = sorted({r[0] for r in rows})
    if len(sizes) > 1:
        shown = "; ".join(f"rank {i}: {r[0]}" for i, r in enumerate(rows))
        raise ValueError(f"nodes of different sizes: the ranks report different ranks per node ({shown})")
    L = sizes[0]
    if L < 1 or world_size % L:
        raise ValueError(f"ranks_per_node={L} must be >= 1 and divide the world size {world_size}")
    if not stated:
        # Node-contiguous: ranks i*L..(i+1)*L-1 share a node identity, in local-rank order.
        nodes = [rows[i][1] for i in range(0, world_size, L)]
        bad = [i for i, r in enumerate(rows) if r[1] != nodes[i // L] or r[2] != i % L]
        if bad or len(set(nodes)) != len(nodes):
            raise ValueError(
                f"the rank layout is not node-contiguous (ranks {bad or 'of different nodes'} do not sit on node "
                f"rank // {L} at local rank rank % {L}); launch with torchrun, which numbers ranks node by node, "
                "or pass VoteConfig(ranks_per_node=L) for a layout you know to be contiguous"
            )
    N = world_size // L
    global_ranks = list(range(world_size)) if group is None else dist.get_process_group_ranks(group)
    node_group = rail_group = None
    # new_group is itself a collective over the default group: every rank creates every group, in one order.
    for node in range(N):
        members = [global_ranks[node * L + i] for i in range(L)]
        created = dist.new_group(members) if L > 1 and N > 1 else None
        if node == rank // L:
            node_group = created
    for local in range(L):
        members = [global_ranks[node * L + local] for node in range(N)]
        created = dist.new_group(members) if L > 1 and N > 1 else None
        if local == rank % L:
            rail_group = created
    if L == 1:
        rail_group = group  # one rank per node: the rail is the whole group
    return NodeLayout(world_size, rank, L, N, node_group, rail_group if N > 1 else None)
