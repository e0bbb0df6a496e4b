"""Majority vote in the packed domain: bit-sliced counting on 64-bit words.

Each of the M voters gives a ``positive`` plane (bit set where its entry is > 0) and, when
it has exact zeros, a ``nonzero`` plane. Counting the voters per bit position with a
bit-sliced ripple-carry adder touches each word ``O(M log M)`` times and never expands a
bit into a float, which is what keeps the collective near memcpy speed.

``vote(...) = sign(#positive - #negative)`` per entry; an entry that is 0 on every voter
votes 0, and a tie between nonzero voters (possible for even M) is 0 unless tie-break bits
are given, in which case their bit picks +1 (set) or -1 (clear).
"""

from __future__ import annotations

import torch

__all__ = ["vote_packed", "vote_reference"]


def _count_planes(planes: torch.Tensor) -> list[torch.Tensor]:
    """Per-bit population count of ``planes`` [M, W] as bit-sliced counter words, LSB first."""
    counter: list[torch.Tensor] = []
    for i, plane in enumerate(planes, start=1):
        carry = plane
        for k in range(len(counter)):
            counter[k], carry = counter[k] ^ carry, counter[k] & carry
        if i >= 1 << len(counter):  # count i needs one more bit
            counter.append(carry)
    return counter


def _compare_counters(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitwise (a > b, a < b) for two bit-sliced counters, scanning from the MSB."""
    ref = a[0] if a else b[0]
    zero = torch.zeros_like(ref)
    width = max(len(a), len(b))
    a = a + [zero] * (width - len(a))
    b = b + [zero] * (width - len(b))
    greater, less, equal = zero.clone(), zero.clone(), ~zero
    for ak, bk in zip(reversed(a), reversed(b)):
        greater |= equal & ak & ~bk
        less |= equal & ~ak & bk
        equal &= ~(ak ^ bk)
    return greater, less


def _compare_to_constant(a: list[torch.Tensor], constant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitwise (a > constant, a == constant) for a bit-sliced counter."""
    greater = torch.zeros_like(a[0])
    equal = ~greater
    for k in reversed(range(max(len(a), constant.bit_length()))):
        ak = a[k] if k < len(a) else torch.zeros_like(greater)
        if (constant >> k) & 1:
            equal &= ak
        else:
            greater |= equal & ak
            equal &= ~ak
    return greater, equal


def vote_packed(
    positive: torch.Tensor,
    nonzero: torch.Tensor | None = None,
    *,
    tie_break: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vote M packed sign vectors.

    Args:
        positive: int64 [M, W], voter i's ``x_i > 0`` bits.
        nonzero: int64 [M, W], voter i's ``x_i != 0`` bits; ``None`` means no voter has a zero
            (the dense case, which takes a cheaper path: compare one counter to M/2).
            ``positive`` bits must be a subset of ``nonzero`` bits.
        tie_break: int64 [W] random bits; ``None`` leaves ties at 0 (exact mode).

    Returns:
        ``(positive, nonzero)`` int64 [W] planes of the voted sign.
    """
    if positive.dim() != 2 or positive.dtype != torch.int64:
        raise ValueError(f"positive must be an int64 [M, W] tensor, got {positive.dtype} {tuple(positive.shape)}")
    voters = positive.shape[0]
    pos_count = _count_planes(positive)
    if nonzero is None:
        # #neg = M - #pos, so sign(#pos - #neg) compares #pos with M/2.
        greater, equal = _compare_to_constant(pos_count, voters // 2)
        if voters % 2:  # odd M: #pos > (M-1)/2 wins, no ties possible
            return greater, ~torch.zeros_like(greater)
        tie = equal
        less = ~(greater | equal)
        any_nonzero = ~torch.zeros_like(greater)
    else:
        if nonzero.shape != positive.shape or nonzero.dtype != torch.int64:
            raise ValueError("nonzero must be an int64 tensor shaped like positive")
        neg_count = _count_planes(nonzero & ~positive)
        greater, less = _compare_counters(pos_count, neg_count)
        any_nonzero = nonzero[0].clone()
        for plane in nonzero[1:]:
            any_nonzero |= plane
        tie = any_nonzero & ~(greater | less)
    if tie_break is None:
        return greater, greater | less
    return greater | (tie & tie_break), greater | less | tie


def vote_reference(signs: torch.Tensor) -> torch.Tensor:
    """``sign(sum_i sign(v_i))`` over dim 0 of float [M, n], ties 0: the definition."""
    return torch.sign(torch.sign(signs.double()).sum(dim=0)).float()
