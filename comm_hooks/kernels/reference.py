"""Slow, obviously-correct Python references every fast kernel is tested against bit for bit.

They work entry by entry on Python floats and ints, with the definitions spelt out:
``positive = x > 0``, ``nonzero = x != 0`` (NaN is "nonzero, not positive", i.e. -1), padding
bits past the data set in both planes, and the vote ``sign(#positive - #negative)``.
"""

from __future__ import annotations

import functools
import math

import torch

from .bits import GOLDEN, MASK64, SignSegments, advance_momentum_then_pack, mix64, words_for

__all__ = ["pack", "momentum_pack", "unpack", "vote", "tie_bit", "tie_words"]


def _to_int64(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 64) if v >> 63 else v for v in values], dtype=torch.int64)


def _to_uint(t: torch.Tensor) -> list[int]:
    return [v & MASK64 for v in t.reshape(-1).tolist()]


def pack(x: torch.Tensor, words: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    values = x.detach().reshape(-1).double().cpu().tolist()
    words = words_for(len(values)) if words is None else words
    positive, nonzero = [MASK64] * words, [MASK64] * words
    zeros, nonfinite = 0, False
    for i, v in enumerate(values):
        w, b = divmod(i, 64)
        if not v > 0:
            positive[w] &= ~(1 << b) & MASK64
        if not v != 0:
            nonzero[w] &= ~(1 << b) & MASK64
            zeros += 1
        nonfinite |= not math.isfinite(v)
    return _to_int64(positive), _to_int64(nonzero), zeros, nonfinite


momentum_pack = functools.partial(advance_momentum_then_pack, pack)
"""Signum's momentum step as torch's ``lerp_`` defines it (skipped where ``skip``), then :func:`pack`."""


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, numel: int) -> torch.Tensor:
    """float64 [numel] in {-1, 0, +1}."""
    pos = _to_uint(positive)
    nz = _to_uint(nonzero) if nonzero is not None else None
    out = []
    for i in range(numel):
        w, b = divmod(i, 64)
        if nz is not None and not (nz[w] >> b) & 1:
            out.append(0.0)
        else:
            out.append(1.0 if (pos[w] >> b) & 1 else -1.0)
    return torch.tensor(out, dtype=torch.float64)


def vote(
    positive: torch.Tensor, nonzero: torch.Tensor | None, tie: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vote [M, S] planes entry by entry; ``tie`` bits pick the sign of ties, else ties are 0."""
    voters, words = positive.shape
    pos = [_to_uint(row) for row in positive]
    nz = [_to_uint(row) for row in nonzero] if nonzero is not None else [[MASK64] * words] * voters
    ties = _to_uint(tie) if tie is not None else None
    out_pos, out_nz = [0] * words, [0] * words
    for w in range(words):
        for b in range(64):
            up = sum((pos[v][w] >> b) & 1 for v in range(voters))
            present = sum((nz[v][w] >> b) & 1 for v in range(voters))
            down = present - up
            sign = (up > down) - (up < down)
            if sign == 0 and present and ties is not None:
                sign = 1 if (ties[w] >> b) & 1 else -1
            out_pos[w] |= (sign > 0) << b
            out_nz[w] |= (sign != 0) << b
    return _to_int64(out_pos), _to_int64(out_nz)


def tie_bit(call_key: int, segment_key: int, index: int) -> int:
    """The tie-break bit of entry ``index`` of a segment: the definition."""
    seg = mix64((call_key ^ segment_key) & MASK64)
    return (mix64((seg + (index >> 6) * GOLDEN) & MASK64) >> (index & 63)) & 1


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int) -> torch.Tensor:
    out = [0] * words
    call_key &= MASK64
    for s, (key, first) in enumerate(zip(segments.keys, segments.first_indices)):
        lo, hi = segments.starts[s], segments.starts[s + 1]
        for e in range(max(lo, first_entry), min(hi, first_entry + 64 * words)):
            w, b = divmod(e - first_entry, 64)
            out[w] |= tie_bit(call_key, key, e - lo + first) << b
    return _to_int64(out)
