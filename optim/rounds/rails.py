"""Node-aware rounds: the ranks of a node all-reduce every step and so hold the same
parameters; between nodes only rails talk: local rank l carries its 1/L slice of the flat
parameters to the ranks of the other nodes with local rank l, and the node gathers the slices."""

from __future__ import annotations

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, NodeLayout
from signmuon.comm_hooks.dist import mean_all_reduce
from signmuon.comm_hooks.vote import gather_in_node

__all__ = ["mean_between_nodes", "gather_slices", "rail_bounds", "rail_group"]


def rail_bounds(numel: int, layout: NodeLayout | None) -> tuple[int, int, int]:
    """(lo, hi, chunk): this rank's slice of a flat tensor of ``numel`` entries, and the slice length."""
    if layout is None:
        return 0, numel, numel
    chunk = -(-numel // layout.ranks_per_node)
    lo = min(numel, layout.local_rank * chunk)
    return lo, min(numel, lo + chunk), chunk


def gather_slices(piece: torch.Tensor, numel: int, layout: NodeLayout | None, stats: CommStats | None) -> torch.Tensor:
    """The node's slices joined back into the flat tensor of ``numel`` entries."""
    if layout is None:
        return piece
    _, _, chunk = rail_bounds(numel, layout)
    padded = torch.zeros(chunk, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    return gather_in_node(padded, layout, stats).reshape(-1)[:numel]


def rail_group(group: dist.ProcessGroup | None, layout: NodeLayout | None) -> dist.ProcessGroup | None:
    """The group a round talks over: this rank's rail in node-aware rounds, else ``group``."""
    return layout.rail_group if layout is not None else group


def mean_between_nodes(
    flat: torch.Tensor, group: dist.ProcessGroup | None, layout: NodeLayout | None, stats: CommStats | None
) -> torch.Tensor:
    """The mean of ``flat`` over the workers: over ``group``, or node-aware (each rank's slice over
    its rail, then the node's slices gathered). ``flat`` may be overwritten."""
    lo, hi, _ = rail_bounds(flat.numel(), layout)
    piece = mean_all_reduce(flat[lo:hi].clone() if layout is not None else flat, rail_group(group, layout), stats)
    return gather_slices(piece, flat.numel(), layout, stats)
