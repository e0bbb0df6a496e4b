"""Scales in 8 bits: each float32 scale >= 0 as a step on a grid of 2^(1/8) below the sender's
largest scale, which travels beside the codes in float32 (the one-bit rounds' ``scale_bits=8``)."""

from __future__ import annotations

import torch

__all__ = ["LOG_STEPS_PER_OCTAVE", "ZERO_CODE", "decode_log_scales", "encode_log_scales"]

LOG_STEPS_PER_OCTAVE = 8  # the grid: 2^(1/8), a 9% step
ZERO_CODE = 255  # a scale of 0 (or below the grid's 254 steps under the largest)


def encode_log_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [n + 4]: each float32 scale >= 0 as ``round(8·log2(largest/scale))`` (``ZERO_CODE``
    for 0 or below the grid), then the largest scale's four bytes."""
    largest = scales.max() if scales.numel() else scales.new_zeros(())
    steps = torch.round(LOG_STEPS_PER_OCTAVE * torch.log2(largest / scales))
    codes = torch.where((scales > 0) & (steps < ZERO_CODE), steps, ZERO_CODE).to(torch.uint8)
    return torch.cat([codes, largest.reshape(1).view(torch.uint8)])


def decode_log_scales(rows: torch.Tensor) -> torch.Tensor:
    """float32 [M, n]: the scales :func:`encode_log_scales` coded in each of ``rows`` [M, n + 4]."""
    # A copy of the last four bytes: view() as float32 needs them 4-byte aligned.
    codes, largest = rows[:, :-4], rows[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    scales = largest * torch.exp2(-codes.to(torch.float32) / LOG_STEPS_PER_OCTAVE)
    return torch.where(codes == ZERO_CODE, 0.0, scales)
