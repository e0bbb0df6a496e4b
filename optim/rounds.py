"""Rounds of local-step training: what a round sends between workers, and the outer step.

A round of plain local SGD (torch's ``PeriodicModelAverager``) moves every worker to the
workers' average. With an outer step (DiLoCo, Douillard et al. 2023) the workers share a
consensus x_prev, and a round steps it with their pseudo-gradients::

    delta_i <- x_prev - x_i            this worker's pseudo-gradient
    delta   <- combine_i(delta_i)      their fp32 mean, or one bit per entry
    x_prev  <- outer optimizer step of x_prev with gradient delta

Node-aware rounds: the ranks of a node all-reduce every step and so hold the same parameters;
between nodes only rails talk: local rank l carries its 1/L slice of the flat parameters to the
ranks of the other nodes with local rank l, and the node gathers the slices back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from signmuon.comm_hooks import CommStats, NodeLayout, VoteConfig, majority_vote
from signmuon.comm_hooks.dist import (
    agree,
    gather_rows,
    group_device,
    group_size_rank,
    mean_all_reduce,
    nonfinite_flag,
    settings_digest,
    tensor_fingerprint,
)
from signmuon.comm_hooks.vote import error_buffer_sizes, gather_in_node, scaled_sign_allreduce

from .params import local_tensor

__all__ = [
    "OuterStep",
    "Consensus",
    "PSEUDO_GRADIENTS",
    "average_over_nodes",
    "check_shards",
    "combine_pseudo_gradients",
    "round_flags",
    "scale_blocks",
]

PSEUDO_GRADIENTS = ("mean", "sign_vote", "sign_vote_ef", "scaled_sign")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterStep:
    """The outer step of rounds, passed whole to :class:`~signmuon.optim.DPPFAverager`."""

    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    """Builds the outer optimizer over the consensus tensors. It gets one flat tensor per dtype
    and device (this rank's slice of it in node-aware rounds), so it must act entry by entry
    (SGD, Adam, AdamW); ``functools.partial(torch.optim.SGD, lr=1.0)`` is plain averaging."""

    pseudo_gradient: str = "mean"
    """How the workers' pseudo-gradients combine: ``"mean"`` (fp32 all-reduce, DiLoCo's),
    ``"sign_vote"`` (the majority vote of their signs, each tensor scaled by the workers' mean
    magnitude of its entries), ``"sign_vote_ef"`` (the same, each worker first adding what its
    scaled signs left out in earlier rounds: error feedback) or ``"scaled_sign"`` (1-bit Adam's
    error-feedback scaled signs, one scale per rank's chunk). All but the first send one bit
    per entry."""

    vote: VoteConfig | None = None
    """Settings of the ``"sign_vote"`` combination; its ``nonfinite`` and ``kernels`` also apply
    to ``"scaled_sign"``. Default ``VoteConfig(tie="exact")``: where the workers split evenly the
    consensus stays (a coin would move it along no direction they share). Free for two workers
    (each computes the vote); from three on, the entries left at zero travel back, up to a
    second bit per entry: ``tie="fast"`` keeps one bit."""

    scale_block: int = 0
    """Entries per scale of ``"sign_vote"`` and ``"sign_vote_ef"``: 0 scales each tensor as a
    whole; ``B`` scales each run of ``B`` entries of a tensor on its own (a 32-bit scale per
    block: ``32/B`` bits per entry more), so the voted signs keep more of the magnitudes."""

    SCALED: ClassVar[tuple[str, ...]] = ("sign_vote", "sign_vote_ef")
    """The rules whose voted signs take ``scale_block`` and ``scale_bits``."""

    scale_bits: int = 32
    """Bits a scale travels in. 32: float32, averaged by an all-reduce. 16: bfloat16, the same
    all-reduce at half the bytes (8 significant bits). 8: a code on a grid of 2^(1/8) steps
    below the worker's largest scale (the float32 largest scale goes along), all-gathered and
    averaged on each rank: ``(M-1)·8/B`` bits per entry with M workers, the least of the three
    below M = 4 and as much as 16 at M = 4 (the all-reduce costs ``2(M-1)/M`` times the scale's
    bits). The error feedback keeps each worker's own scale in float32."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_block, bool) or not isinstance(self.scale_block, int) or self.scale_block < 0:
            raise ValueError(
                f"OuterStep.scale_block={self.scale_block!r} must be an int >= 0 (0: one scale per tensor)"
            )
        if isinstance(self.scale_bits, bool) or self.scale_bits not in (32, 16, 8):
            raise ValueError(f"OuterStep.scale_bits={self.scale_bits!r} must be 32, 16 or 8")
        if (self.scale_block or self.scale_bits != 32) and self.pseudo_gradient not in self.SCALED:
            raise ValueError(
                f"OuterStep.scale_block and scale_bits set the scales of {self.SCALED}; "
                f"pseudo_gradient={self.pseudo_gradient!r} has none"
            )
        if not callable(self.optimizer):
            raise ValueError(
                f"OuterStep.optimizer={self.optimizer!r} must build an optimizer from a list of tensors, "
                "e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
            )
        if self.pseudo_gradient not in PSEUDO_GRADIENTS:
            raise ValueError(f"pseudo_gradient={self.pseudo_gradient!r} must be one of {PSEUDO_GRADIENTS}")
        if self.vote is not None and not isinstance(self.vote, VoteConfig):
            raise ValueError(f"OuterStep.vote must be a VoteConfig, not {type(self.vote).__name__}")
        if self.vote is not None and self.vote.hierarchical:
            raise ValueError(
                "OuterStep.vote: hierarchical=True does not apply; pass layout= to DPPFAverager for node-aware rounds"
            )

    @classmethod
    def diloco(cls, lr: float = 0.7, momentum: float = 0.9, pseudo_gradient: str = "mean") -> OuterStep:
        """DiLoCo's outer step: Nesterov SGD (``lr=0.7, momentum=0.9``) on the pseudo-gradient."""
        return cls(
            optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=True),
            pseudo_gradient=pseudo_gradient,
        )


def _rail_bounds(numel: int, layout: NodeLayout | None) -> tuple[int, int, int]:
    """(lo, hi, chunk): this rank's slice of a flat tensor of ``numel`` entries, and the slice length."""
    if layout is None:
        return 0, numel, numel
    chunk = -(-numel // layout.ranks_per_node)
    lo = min(numel, layout.local_rank * chunk)
    return lo, min(numel, lo + chunk), chunk


def _gather_slices(piece: torch.Tensor, numel: int, layout: NodeLayout | None, stats: CommStats | None) -> torch.Tensor:
    """The node's slices joined back into the flat tensor of ``numel`` entries."""
    if layout is None:
        return piece
    _, _, chunk = _rail_bounds(numel, layout)
    padded = torch.zeros(chunk, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    return gather_in_node(padded, layout, stats).reshape(-1)[:numel]


def _exchange_group(group: dist.ProcessGroup | None, layout: NodeLayout | None) -> dist.ProcessGroup | None:
    return layout.rail_group if layout is not None else group


def average_over_nodes(
    flat: torch.Tensor, group: dist.ProcessGroup | None, layout: NodeLayout | None, stats: CommStats | None
) -> torch.Tensor:
    """The mean of ``flat`` over the workers: over ``group``, or node-aware (each rank's slice over
    its rail, then the node's slices gathered). ``flat`` may be overwritten."""
    lo, hi, _ = _rail_bounds(flat.numel(), layout)
    piece = mean_all_reduce(flat[lo:hi].clone() if layout is not None else flat, _exchange_group(group, layout), stats)
    return _gather_slices(piece, flat.numel(), layout, stats)


def combine_pseudo_gradients(
    delta: torch.Tensor,
    how: str,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
    *,
    segments: list[tuple[int, int, int]],
    errors: tuple[torch.Tensor, ...] = (),
    vote: VoteConfig | None = None,
    step: int = 0,
    scale_bits: int = 32,
) -> torch.Tensor:
    """Combine the workers' pseudo-gradients ``delta`` (flat; overwritten) over ``group``.

    ``segments`` are ``(start, stop, width)`` runs of ``delta`` cut into blocks of ``width``
    entries (:func:`scale_blocks`): ``"sign_vote"`` scales each block by the workers' mean of its
    mean magnitude, the blocks of a run as the rows of one view (no Python loop per block). ``errors`` are the feedback buffers: (worker,
    server) for ``"scaled_sign"``, (worker,) for ``"sign_vote_ef"``; ``step`` keys the tie coins;
    the scales travel in ``scale_bits`` (``OuterStep.scale_bits``).
    """
    vote = vote if vote is not None else VoteConfig(tie="exact")
    if how == "mean":
        return mean_all_reduce(delta, group, stats)
    if how == "scaled_sign":
        return scaled_sign_allreduce(
            delta,
            *errors,
            group,
            kernels=vote.kernels,
            nonfinite=vote.nonfinite,
            stats=stats,
            label="a round's pseudo-gradient",
        )
    if how == "sign_vote_ef":
        delta.add_(errors[0])
    blocks = [delta[a:b].view(-1, width) for a, b, width in segments]  # [blocks, width] each
    scales = torch.cat([rows.abs().mean(dim=1) for rows in blocks]) if blocks else delta.new_zeros(0)
    counts = [rows.shape[0] for rows in blocks]
    if how == "sign_vote_ef":  # what this worker's own scaled signs leave out
        for (a, b, width), rows, scale in zip(segments, blocks, scales.split(counts)):
            torch.sub(rows, rows.sign() * scale.unsqueeze(1), out=errors[0][a:b].view(-1, width))
    scales = _average_scales(scales, scale_bits, group, stats)
    majority_vote(delta, group, vote, step=step, out=delta, stats=stats, label="a round's pseudo-gradient")
    for rows, scale in zip(blocks, scales.split(counts)):
        rows.mul_(scale.unsqueeze(1))
    return delta


LOG_STEPS_PER_OCTAVE = 8  # the 8-bit scales' grid: 2^(1/8), a 9% step
ZERO_CODE = 255  # an 8-bit scale of 0 (or below the grid's 254 steps under the largest)


def _average_scales(
    scales: torch.Tensor, bits: int, group: dist.ProcessGroup | None, stats: CommStats | None
) -> torch.Tensor:
    """The workers' mean of each float32 scale, sent in ``bits`` (``OuterStep.scale_bits``)."""
    if bits == 32:
        return mean_all_reduce(scales, group, stats)
    if bits == 16:
        return mean_all_reduce(scales.to(torch.bfloat16), group, stats).to(scales.dtype)
    return _log8_decode(gather_rows(_log8_encode(scales), group, stats)).mean(0)


def _log8_encode(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [n + 4]: each float32 scale >= 0 as ``round(8·log2(largest/scale))`` (``ZERO_CODE``
    for 0 or below the grid), then the largest scale's four bytes."""
    largest = scales.max() if scales.numel() else scales.new_zeros(())
    steps = torch.round(LOG_STEPS_PER_OCTAVE * torch.log2(largest / scales))
    codes = torch.where((scales > 0) & (steps < ZERO_CODE), steps, ZERO_CODE).to(torch.uint8)
    return torch.cat([codes, largest.reshape(1).view(torch.uint8)])


def _log8_decode(rows: torch.Tensor) -> torch.Tensor:
    """float32 [M, n]: the scales :func:`_log8_encode` coded in each of ``rows`` [M, n + 4]."""
    # A copy of the last four bytes: view() as float32 needs them 4-byte aligned.
    codes, largest = rows[:, :-4], rows[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    scales = largest * torch.exp2(-codes.to(torch.float32) / LOG_STEPS_PER_OCTAVE)
    return torch.where(codes == ZERO_CODE, 0.0, scales)


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
            lo, hi, _ = _rail_bounds(sum(t.numel() for t in tensors), layout)
            self.tensors.append(torch.cat([t.detach().reshape(-1) for t in tensors])[lo:hi].clone())
        self.optimizer = outer.optimizer(self.tensors)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"OuterStep.optimizer built a {type(self.optimizer).__name__}, not a torch.optim.Optimizer"
            )
        self.errors: list[tuple[torch.Tensor, ...]] = []
        if outer.pseudo_gradient == "sign_vote_ef":
            self.errors = [(torch.zeros_like(c),) for c in self.tensors]
        if outer.pseudo_gradient == "scaled_sign":
            ranks, _ = group_size_rank(_exchange_group(group, layout))
            for c in self.tensors:
                worker, server = error_buffer_sizes(c.numel(), ranks)
                self.errors.append((c.new_zeros(worker), c.new_zeros(server)))
        self.rounds = 0

    def check_same_start(self, stats: CommStats | None) -> None:
        """Raise on every rank unless all start from the same consensus (an averager built before
        DDP made the parameters equal would otherwise step a different consensus on each rank)."""
        prints = {f"group {i}": int(tensor_fingerprint(c)) for i, c in enumerate(self.tensors)}
        agree(
            prints,
            _exchange_group(self.group, self.layout),
            stats=stats,
            what="the first round with different "
            "consensus parameters (build DPPFAverager after DDP, which makes the workers' parameters equal)",
        )

    @torch.no_grad()
    def reset(self, flats: list[torch.Tensor]) -> None:
        """Start again from ``flats`` (the same on every rank: the end of the warm-up)."""
        for c, flat in zip(self.tensors, flats):
            lo, hi, _ = _rail_bounds(flat.numel(), self.layout)
            c.copy_(flat[lo:hi])

    @torch.no_grad()
    def advance(self, flats: list[torch.Tensor], stats: CommStats | None) -> list[torch.Tensor]:
        """One round: combine the workers' pseudo-gradients, step the consensus; returns the new
        consensus of each group, whole."""
        group = _exchange_group(self.group, self.layout)
        for i, (c, flat) in enumerate(zip(self.tensors, flats)):
            lo, hi, _ = _rail_bounds(flat.numel(), self.layout)
            delta = c - flat[lo:hi]
            c.grad = combine_pseudo_gradients(
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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.rounds += 1
        return self.whole(stats)

    def whole(self, stats: CommStats | None = None) -> list[torch.Tensor]:
        """Each group's consensus, whole (gathered inside the node in node-aware rounds: a collective)."""
        return [_gather_slices(c, sum(sizes), self.layout, stats) for c, sizes in zip(self.tensors, self.sizes)]

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


@functools.lru_cache(maxsize=64)
def scale_blocks(sizes: tuple[int, ...], lo: int, hi: int, block: int = 0) -> list[tuple[int, int, int]]:
    """The scale blocks of the slice [lo, hi) of a flat group of tensors of ``sizes``, as
    ``(start, stop, width)`` runs relative to ``lo``: each run is whole blocks of ``width``
    entries, in order. ``block`` 0: one block per tensor; else each tensor's runs of ``block``
    entries counted from its start, so a tensor gives at most three runs (a block cut by ``lo``,
    its whole blocks, its last short block, or one cut by ``hi``), whatever its size."""
    found, start = [], 0
    for size in sizes:
        a, b = max(start, lo), min(start + size, hi)
        if b > a:
            width = block or size
            cut = start + -(-(a - start) // width) * width  # the first block boundary at or after a
            whole = start + (b - start) // width * width  # the last one at or before b
            if cut >= b:  # inside one block
                found.append((a - lo, b - lo, b - a))
            else:
                if cut > a:
                    found.append((a - lo, cut - lo, cut - a))
                if whole > cut:
                    found.append((cut - lo, whole - lo, width))
                if b > whole:
                    found.append((whole - lo, b - lo, b - whole))
        start += size
    return found


@torch.no_grad()
def round_flags(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    group: dist.ProcessGroup,
    step: int,
    stats: CommStats,
    *,
    settings: int = 0,
    unchecked: bool = False,
) -> tuple[list[torch.Tensor], list[int], bool]:
    """(the parameters with a gradient on any rank, the ranks holding NaN/Inf in those or in
    ``buffers``, whether any rank is ``unchecked``): one all-gather, after checking that every
    rank is at the same step with the same parameter shapes and ``settings`` digest (else
    ``VoteMismatchError`` on every rank, rather than a collective of mismatched sizes).
    Parameters with a gradient on any rank take part everywhere, so one unused on a single rank
    is still averaged consistently."""
    device = group_device(group)
    layout = settings_digest({"shapes": [(str(p.dtype), tuple(p.shape)) for p in params]})
    fields = {"step": step, "parameters": len(params), "layout": layout, "settings": settings}
    agree(fields, group, what="a DPPF round", stats=stats)
    # [P + 1, 2] uint8: (has a gradient, holds NaN/Inf) per parameter, then (unchecked, the buffers' NaN/Inf).
    flags = torch.zeros(len(params) + 1, 2, dtype=torch.uint8, device=device)
    flags[-1, 0] = int(unchecked)
    if params:
        flags[:-1, 0] = torch.tensor([p.grad is not None for p in params], device=device)
        flags[:-1, 1] = torch.stack([nonfinite_flag(local_tensor(p).detach()).to(device) for p in params])
    if buffers:
        flags[-1, 1] = torch.stack([nonfinite_flag(b).to(device) for b in buffers]).any()
    gathered = gather_rows(flags, group, stats).bool()  # [M, P + 1, 2]
    used = gathered[:, :-1, 0].any(dim=0)  # [P]
    bad = (gathered[:, :-1, 1] & used).any(dim=1) | gathered[:, -1, 1]  # [M]
    return (
        [p for p, u in zip(params, used.tolist()) if u],
        bad.nonzero().view(-1).tolist(),
        bool(gathered[:, -1, 0].any()),
    )


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
