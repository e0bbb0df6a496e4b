"""Device-agnostic torch kernels: the fallback ``VoteConfig(kernels="torch")`` selects.

Plain tensor operations, correct on any device and dtype, but with several passes over the
data and temporaries of the input's size: slower than the fused CPU (numba) and CUDA
(Triton) kernels. Tested against the references bit for bit like them.
"""

from __future__ import annotations

import functools

import torch

from ..vote import vote_packed
from .layout import SignSegments

__all__ = ["pack", "unpack", "vote", "tie_words", "NAME"]

NAME = "torch"


@functools.lru_cache(maxsize=None)
def _bit_weights(device: torch.device) -> torch.Tensor:
    return (torch.ones(64, dtype=torch.int64, device=device) << torch.arange(64, device=device))


def _words(bits: torch.Tensor, words: int) -> torch.Tensor:
    """bool [n] -> int64 [words], bit k of word j = entry 64j+k; padding bits set."""
    padded = torch.ones(words * 64, dtype=torch.bool, device=bits.device)
    padded[: bits.numel()] = bits
    # Distinct powers of two: a sum is an OR, and int64 wraps bit 63 into the sign as wanted.
    return (padded.view(words, 64).to(torch.int64) * _bit_weights(bits.device)).sum(dim=1)


def pack(x: torch.Tensor, words: int):
    nonzero_bits = x != 0
    positive = _words(x > 0, words)
    nonzero = _words(nonzero_bits, words)
    zeros = x.numel() - nonzero_bits.sum()
    nonfinite = ~torch.isfinite(x).all() if x.numel() else torch.zeros((), dtype=torch.bool, device=x.device)
    return positive, nonzero, zeros, nonfinite


def _bits(words: torch.Tensor, numel: int) -> torch.Tensor:
    weights = _bit_weights(words.device)
    return ((words.unsqueeze(1) & weights) != 0).view(-1)[:numel]


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, out: torch.Tensor) -> None:
    numel = out.numel()
    values = torch.where(_bits(positive, numel), 1.0, -1.0).to(out.dtype)
    if nonzero is not None:
        values = values.masked_fill_(~_bits(nonzero, numel), 0.0)
    out.copy_(values)


def vote(positive: torch.Tensor, nonzero: torch.Tensor | None, dense: torch.Tensor | None, tie: torch.Tensor | None):
    if nonzero is not None and dense is not None:
        nonzero = torch.where(dense.to(positive.device).unsqueeze(1), torch.full_like(nonzero, -1), nonzero)
    return vote_packed(positive, nonzero, tie_break=tie)


_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 like the unsigned arithmetic of the definition.
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    entries = torch.arange(first_entry, first_entry + 64 * words, dtype=torch.int64, device=device)
    starts = torch.tensor(segments.starts, dtype=torch.int64, device=device)
    seg = (torch.searchsorted(starts, entries, right=True) - 1).clamp(0, len(segments.keys) - 1)
    keys = torch.tensor([_signed(k & ((1 << 64) - 1)) for k in segments.keys], dtype=torch.int64, device=device)
    index = entries - starts[seg]
    seg_key = _mix64(keys[seg] ^ _signed(call_key & ((1 << 64) - 1)))
    h = _mix64(seg_key + _shr(index, 6) * _signed(_GOLDEN))
    bits = (h >> (index & 63)) & 1
    bits = bits.masked_fill_(entries >= segments.numel, 0)
    return (bits.view(words, 64) * _bit_weights(entries.device)).sum(dim=1)
