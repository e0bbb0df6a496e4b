"""What the sharded exchanges share, FSDP2's row shards (:mod:`.fsdp`) and DeepSpeed ZeRO's flat
partitions (:mod:`signmuon.integrations.deepspeed`): each voted parameter's spec, with the owner
rule, and one vote of a set of shards between nodes."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from signmuon.comm_hooks.shard_vote import ShardSpec, ShardVoter

from .exchanges import Exchanged
from .sign_vote import SignVoteOptimizer

__all__ = ["shard_specs", "vote_shards"]


def shard_specs(
    optimizer: SignVoteOptimizer,
    ranks_per_node: int,
    ranges: Mapping[torch.Tensor, tuple[tuple[int, int], ...]] | None = None,
) -> dict[torch.Tensor, ShardSpec]:
    """Each voted parameter's :class:`~signmuon.comm_hooks.shard_vote.ShardSpec`, keyed by the
    parameter: its number among the voted ones in param-group order (the tie coins' key) and, on
    a path that needs the whole tensor (SignMuon's matrices), its owner, ``optimizer.owner``:
    largest Newton–Schulz cost first, to the least loaded local rank. The rule reads only the
    shapes, so row shards and ZeRO partitions of one model put each matrix at the same local rank.

    ``ranges``: per parameter, each local rank's element range of it (ZeRO); None: row shards."""
    voted = [p for g in optimizer.param_groups for p in g["params"] if optimizer.votes(p)]
    specs = {}
    for key, p in enumerate(voted):
        owner = optimizer.owner(p, ranks_per_node) if optimizer.route(p)[1] in optimizer.whole_paths else None
        specs[p] = ShardSpec(tuple(p.shape), key, owner, None if ranges is None else ranges[p])
    return specs


def vote_shards(
    optimizer: SignVoteOptimizer,
    voter: ShardVoter,
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    specs: Mapping[torch.Tensor, ShardSpec],
    *,
    label: str,
    tag: int | None = None,
    mean_tag: int | None = None,
) -> Exchanged:
    """Vote ``params`` from this rank's shards of their node-mean gradients (``grads``; None: no
    gradient on this node, which abstains): the voted ones' shards of the update (``finish_vote``
    already applied at the owner), the averaged ones' shards of the mean gradient. ``tag`` tags
    the vote on the rail; ``mean_tag`` the mean where nothing is voted (None: unchecked)."""
    grad_of = dict(zip(params, grads))
    voted, averaged = optimizer.split_by_path(params)
    finish = None
    if any(optimizer.finishes(g, path) for g, _, path in voted):
        finish = lambda i, signs: optimizer.finish_vote(voted[i][0], voted[i][1], signs, voted[i][2])  # noqa: E731
    signs = voter.vote(
        [grad_of[p] for _, p, _ in voted],
        [specs[p] for _, p, _ in voted],
        lambda i, grad: optimizer.elementwise_direction(voted[i][1], grad),
        lambda i, direction: optimizer.whole_direction(voted[i][1], direction),
        finish,
        step=optimizer.steps_taken,
        label=label,
        tag=tag,
    )
    means = voter.mean(
        [grad_of[p] for _, p, _ in averaged],
        [tuple(optimizer.local_part(p).shape) for _, p, _ in averaged],
        tag=mean_tag if not voted else None,  # a vote checks its tag itself
        label=label,
    )
    return Exchanged(voted, signs, averaged, means)
