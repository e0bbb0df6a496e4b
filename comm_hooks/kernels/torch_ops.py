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


def _logical_shr(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 by per-element amounts in [0, 63]."""
    return (z >> shift) & ~((-1 << (63 - shift)) << 1)


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    """Word by word: a word inside one segment is two hash words shifted together; only the
    few words that cross a segment boundary (or the end of the data) go entry by entry."""
    starts = torch.tensor(segments.starts, dtype=torch.int64, device=device)
    keys = torch.tensor([_signed(k & ((1 << 64) - 1)) for k in segments.keys], dtype=torch.int64, device=device)
    key = _signed(call_key & ((1 << 64) - 1))
    low_entry = first_entry + 64 * torch.arange(words, dtype=torch.int64, device=device)  # [words]
    seg = (torch.searchsorted(starts, low_entry, right=True) - 1).clamp(0, len(segments.keys) - 1)
    index = low_entry - starts[seg]
    seg_key = _mix64(keys[seg] ^ key)
    block, offset = _shr(index, 6), index & 63
    first = _mix64(seg_key + block * _signed(_GOLDEN))
    second = _mix64(seg_key + (block + 1) * _signed(_GOLDEN))
    out = _logical_shr(first, offset) | torch.where(offset > 0, second << ((64 - offset) & 63), 0)
    crossing = (starts[seg + 1] < low_entry + 64).nonzero().view(-1)
    if crossing.numel():
        entries = low_entry[crossing].unsqueeze(1) + torch.arange(64, device=device)  # [k, 64]
        eseg = (torch.searchsorted(starts, entries, right=True) - 1).clamp(0, len(segments.keys) - 1)
        eindex = entries - starts[eseg]
        h = _mix64(_mix64(keys[eseg] ^ key) + _shr(eindex, 6) * _signed(_GOLDEN))
        bits = ((h >> (eindex & 63)) & 1).masked_fill_(entries >= segments.numel, 0)
        out[crossing] = (bits * _bit_weights(entries.device)).sum(dim=1)
    return out
