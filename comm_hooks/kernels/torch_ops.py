"""Device-agnostic torch kernels: the fallback ``VoteConfig(kernels="torch")`` selects.

Plain tensor operations, correct on any device and dtype, but with several passes over the
data and temporaries of the input's size: slower than the fused CPU (numba) and CUDA
(Triton) kernels. Tested against the references bit for bit like them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .bits import GOLDEN, MASK64, SignSegments, advance_momentum_then_pack, as_signed, shift_right

__all__ = ["pack", "momentum_pack", "unpack", "vote", "vote_packed", "tie_words", "popcount64", "NAME"]

NAME = "torch"


@functools.lru_cache(maxsize=None)
def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.ones(64, dtype=torch.int64, device=device) << torch.arange(64, device=device)


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


momentum_pack = functools.partial(advance_momentum_then_pack, pack)


def _bits(words: torch.Tensor, numel: int) -> torch.Tensor:
    weights = _bit_weights(words.device)
    return ((words.unsqueeze(1) & weights) != 0).view(-1)[:numel]


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, out: torch.Tensor) -> None:
    numel = out.numel()
    values = torch.where(_bits(positive, numel), 1.0, -1.0).to(out.dtype)
    if nonzero is not None:
        values = values.masked_fill_(~_bits(nonzero, numel), 0.0)
    out.copy_(values)


def vote(positive: torch.Tensor, nonzero: torch.Tensor | None, dense, tie: torch.Tensor | None):
    if nonzero is not None and dense is not None and any(dense):
        nonzero = nonzero.clone()
        for voter in (v for v, no_zeros in enumerate(dense) if no_zeros):  # on the host: no index tensor to copy
            nonzero[voter].fill_(-1)
    return vote_packed(positive, nonzero, tie_break=tie)


# -- the vote in the packed domain: bit-sliced counting on 64-bit words ------------------
#
# Each of the M voters gives a ``positive`` plane (bit set where its entry is > 0) and, when it
# has exact zeros, a ``nonzero`` plane. Counting the voters per bit position with a bit-sliced
# ripple-carry adder touches each word O(M log M) times and never expands a bit into a float.


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


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits per int64 word: numpy's ``bitwise_count`` (one SIMD pass) for CPU tensors where
    numpy has it (2.0+), else SWAR (int64 arithmetic wraps like the unsigned definition)."""
    if x.device.type == "cpu" and hasattr(np, "bitwise_count"):
        return torch.from_numpy(np.bitwise_count(x.contiguous().numpy().view(np.uint64)).astype(np.int64))
    return _popcount_swar(x)


def _popcount_swar(x: torch.Tensor) -> torch.Tensor:
    x = x - (shift_right(x, 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + (shift_right(x, 2) & 0x3333333333333333)
    x = (x + shift_right(x, 4)) & 0x0F0F0F0F0F0F0F0F
    return shift_right(x * 0x0101010101010101, 56)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """``layout.mix64`` on int64 words: int64 multiplication wraps modulo 2**64 like the
    unsigned arithmetic of the definition."""
    z = (z ^ shift_right(z, 30)) * as_signed(0xBF58476D1CE4E5B9)
    z = (z ^ shift_right(z, 27)) * as_signed(0x94D049BB133111EB)
    return z ^ shift_right(z, 31)


def _logicalshift_right(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 by per-element amounts in [0, 63]."""
    return (z >> shift) & ~((-1 << (63 - shift)) << 1)


@functools.lru_cache(maxsize=256)
def _tie_tables(segments: SignSegments, first_entry: int, words: int, device: torch.device):
    """What the tie bits of a layout need besides the call key, on ``device``: per word its
    segment's key and its first entry's index there; for the few words that cross a segment
    boundary (or the end of the data), the same per entry. Built on the host once per layout
    (a DDP bucket's, a shard's), so a call reads nothing back from the device."""
    starts = np.asarray(segments.starts, dtype=np.int64)
    keys = np.asarray([as_signed(k & MASK64) for k in segments.keys], dtype=np.int64)
    firsts = np.asarray(segments.first_indices, dtype=np.int64)
    last = len(segments.keys) - 1
    low_entry = first_entry + 64 * np.arange(words, dtype=np.int64)
    seg = np.clip(np.searchsorted(starts, low_entry, side="right") - 1, 0, last)
    index = low_entry - starts[seg] + firsts[seg]
    crossing = np.flatnonzero(starts[seg + 1] < low_entry + 64)
    entries = low_entry[crossing, None] + np.arange(64, dtype=np.int64)  # [k, 64]
    eseg = np.clip(np.searchsorted(starts, entries, side="right") - 1, 0, last)
    eindex = entries - starts[eseg] + firsts[eseg]
    inside = entries < segments.numel
    host = (keys[seg], index, crossing, keys[eseg], eindex, inside)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in host)


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    """Word by word: a word inside one segment is two hash words shifted together; only the
    few words that cross a segment boundary (or the end of the data) go entry by entry. The
    layout's tables are cached on the device (:func:`_tie_tables`): no host synchronisation."""
    seg_keys, index, crossing, entry_keys, eindex, inside = _tie_tables(
        segments, first_entry, words, torch.device(device or "cpu")
    )
    key = as_signed(call_key & MASK64)
    seg_key = _mix64(seg_keys ^ key)
    block, offset = shift_right(index, 6), index & 63
    first = _mix64(seg_key + block * as_signed(GOLDEN))
    second = _mix64(seg_key + (block + 1) * as_signed(GOLDEN))
    out = _logicalshift_right(first, offset) | torch.where(offset > 0, second << ((64 - offset) & 63), 0)
    if crossing.numel():  # known on the host: the tables' shape
        h = _mix64(_mix64(entry_keys ^ key) + shift_right(eindex, 6) * as_signed(GOLDEN))
        bits = ((h >> (eindex & 63)) & 1) * inside
        out[crossing] = (bits * _bit_weights(eindex.device)).sum(dim=1)
    return out
