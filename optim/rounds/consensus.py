"""The state rounds with an outer step share (the consensus, its outer optimizer and error
feedback), and the refusal of rounds over mixed shards."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from signmuon.comm_hooks import CommStats, NodeLayout
from signmuon.comm_hooks.dist import agree, tensor_fingerprint

from .outer_step import OuterStep
from .pseudo_gradients import RULES, Combining, scale_blocks, start_combining
from .rails import gather_slices, rail_bounds, rail_group

__all__ = ["Consensus", "check_shards"]


class Consensus:
    """State of rounds with an outer step: the consensus x_prev of each flat parameter group
    (this rank's rail slice of it in node-aware rounds), the outer optimizer over it, and the
    error-feedback buffers of ``"sign_vote_ef"`` and ``"scaled_sign"``."""

    def __init__(
        self,
        groups: list[list[torch.Tensor]],
        outer: OuterStep,
        group: dist.ProcessGroup | None,
        layout: NodeLayout | None,
    ) -> None:
        self.outer, self.group, self.layout = outer, group, layout
        self.sizes = [tuple(t.numel() for t in tensors) for tensors in groups]
        self.tensors = []
        for tensors in groups:
            lo, hi, _ = rail_bounds(sum(t.numel() for t in tensors), layout)
            self.tensors.append(torch.cat([t.detach().reshape(-1) for t in tensors])[lo:hi].clone())
        self.optimizer = outer.optimizer(self.tensors)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"OuterStep.optimizer built a {type(self.optimizer).__name__}, not a torch.optim.Optimizer"
            )
        sizes = RULES[outer.pseudo_gradient].error_sizes
        self.errors: list[tuple[torch.Tensor, ...]] = []
        if sizes is not None:
            self.errors = [
                tuple(c.new_zeros(n) for n in sizes(c.numel(), rail_group(group, layout))) for c in self.tensors
            ]
        self.rounds = 0

    def check_same_start(self, stats: CommStats | None) -> None:
        """Raise on every rank unless all start from the same consensus (an averager built before
        DDP made the parameters equal would otherwise step a different consensus on each rank)."""
        prints = {f"group {i}": int(tensor_fingerprint(c)) for i, c in enumerate(self.tensors)}
        agree(
            prints,
            rail_group(self.group, self.layout),
            stats=stats,
            what="the first round with different "
            "consensus parameters (build LocalStepAverager after DDP, which makes the workers' parameters equal)",
        )

    @torch.no_grad()
    def reset(self, flats: list[torch.Tensor]) -> None:
        """Start again from ``flats`` (the same on every rank: the end of the warm-up)."""
        for c, flat in zip(self.tensors, flats):
            lo, hi, _ = rail_bounds(flat.numel(), self.layout)
            c.copy_(flat[lo:hi])

    @torch.no_grad()
    def pseudo_gradients(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """This worker's pseudo-gradient of each group (its rail slice in node-aware rounds)."""
        return [c - flat[lo:hi] for c, flat, (lo, hi) in zip(self.tensors, flats, self.bounds())]

    def bounds(self) -> list[tuple[int, int]]:
        """(lo, hi) of this rank's slice of each flat group."""
        return [rail_bounds(sum(sizes), self.layout)[:2] for sizes in self.sizes]

    @torch.no_grad()
    def start_combining(
        self, deltas: list[torch.Tensor], stats: CommStats | None, group: dist.ProcessGroup | None = None
    ) -> list[Combining]:
        """Start combining the workers' pseudo-gradients (``deltas`` overwritten), one per group:
        only the round's collectives between the workers, issued asynchronously, no state but
        the error feedback touched, so training may go on until they are waited for (streaming
        rounds); over ``group`` in flat rounds (default: the rounds' group), over the rails in
        node-aware ones."""
        group = rail_group(self.group if group is None else group, self.layout)
        return [
            start_combining(
                delta,
                self.outer.pseudo_gradient,
                group,
                stats,
                segments=scale_blocks(self.sizes[i], lo, hi, self.outer.scale_block),
                errors=self.errors[i] if self.errors else (),
                vote=self.outer.vote,
                step=self.rounds,
                scale_bits=self.outer.scale_bits,
            )
            for i, (delta, (lo, hi)) in enumerate(zip(deltas, self.bounds()))
        ]

    def combine(self, deltas: list[torch.Tensor], stats: CommStats | None) -> list[torch.Tensor]:
        """:meth:`start_combining`, waited for."""
        return [combining.wait() for combining in self.start_combining(deltas, stats)]

    @torch.no_grad()
    def land(self, combined: list[torch.Tensor], stats: CommStats | None) -> list[torch.Tensor]:
        """Step the consensus with the ``combined`` pseudo-gradients; returns it whole."""
        for c, grad in zip(self.tensors, combined):
            c.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.rounds += 1
        return self.whole(stats)

    def whole(self, stats: CommStats | None = None) -> list[torch.Tensor]:
        """Each group's consensus, whole (gathered inside the node in node-aware rounds: a collective)."""
        return [gather_slices(c, sum(sizes), self.layout, stats) for c, sizes in zip(self.tensors, self.sizes)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "tensors": [c.detach().clone() for c in self.tensors],
            "optimizer": self.optimizer.state_dict(),
            "errors": [tuple(e.clone() for e in buffers) for buffers in self.errors],
            "rounds": self.rounds,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        shapes = [tuple(t.shape) for t in state["tensors"]]
        if shapes != [tuple(c.shape) for c in self.tensors]:
            raise ValueError(
                f"the checkpoint's consensus has slices of {shapes} entries, this averager {[tuple(c.shape) for c in self.tensors]}: "
                "another model, or another node layout"
            )
        saved_errors = [[tuple(e.shape) for e in buffers] for buffers in state["errors"]]
        if saved_errors != [[tuple(e.shape) for e in buffers] for buffers in self.errors]:
            raise ValueError(
                "the checkpoint's error-feedback buffers do not fit this averager's: it was saved with another "
                f"pseudo_gradient rule than {self.outer.pseudo_gradient!r}, or another node layout"
            )
        for c, saved in zip(self.tensors, state["tensors"]):
            c.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        for buffers, saved in zip(self.errors, state["errors"]):
            for e, saved_e in zip(buffers, saved):
                e.copy_(saved_e)
        self.rounds = int(state["rounds"])


def check_shards(module: nn.Module, group: dist.ProcessGroup, push: float, layout: NodeLayout | None) -> None:
    """Refuse rounds over ranks that hold different shards of a parameter (FSDP2's DTensors)."""
    sharded = [p for p in module.parameters() if p.requires_grad and isinstance(p, DTensor)]
    if not sharded:
        return
    if push or layout is not None:
        raise ValueError(
            "a model sharded by FSDP2: rounds run on each rank's shards over its rail; push (a worker's distance "
            "would be one shard's) and layout= (FSDP2 already runs the node) do not apply"
        )
    try:
        group_ranks = set(dist.get_process_group_ranks(group))
    except KeyError:  # outside the registry: torchft's groups join one local rank of each replica group, one shard
        return
    for p in sharded:
        holders = set(p.device_mesh.mesh.reshape(-1).tolist())  # the ranks sharing this parameter
        if len(holders & group_ranks) > 1:
            raise ValueError(
                f"the rounds' process group holds {len(holders & group_ranks)} shards of one FSDP2 parameter: average "
                "over the ranks that hold the same shard, process_group=mesh['node'].get_group() of node_mesh()"
            )
