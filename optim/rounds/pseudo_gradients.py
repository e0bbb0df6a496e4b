"""How a round combines the workers' pseudo-gradients, one function per rule of
:attr:`OuterStep.pseudo_gradient <signmuon.optim.rounds.OuterStep.pseudo_gradient>`."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, VoteConfig, majority_vote
from signmuon.comm_hooks.dist import gather_rows, mean_all_reduce
from signmuon.comm_hooks.vote import scaled_sign_allreduce

__all__ = ["combine_pseudo_gradients", "scale_blocks"]


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
