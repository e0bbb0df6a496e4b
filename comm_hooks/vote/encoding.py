"""The sign encoding of the majority vote: what a shard holds, how it is voted and decoded.

A rank's shard of a tensor travels as its ``positive`` plane (one bit per entry). Exact zeros
(a rank abstains where its entry is 0) travel only when there are any, as the cheapest of:

* a **zero list**: the positions of the zeros inside the shard, 32 bits each
  (``ceil(k/2)`` words for k zeros);
* **zero runs**: (start, length) of each maximal run of consecutive zeros, 32 bits each (one
  word per run): an embedding's rows of tokens absent from the batch, a dead unit's row;
* a **zero plane**: the shard's ``nonzero`` plane, ``S`` words,

decided per rank and shard from the counts (a list where it ties with runs), and announced in the row's header (flag and
length), so receivers size the extra exchange without a round trip. The voted shard's zeros
(entries that are 0 on every voter, and ties in ``"exact"`` mode) travel back the same way.
So a tensor with k zeros in r runs costs ``min(ceil(k/2), r, S)`` words more than the dense
formula: never more than a second bit plane.

Ties (even numbers of voters) in ``"fast"`` mode take the bit of a hash of (seed, step,
segment key, index inside the segment) (``kernels.reference.tie_bit`` defines it): every rank draws the
same coin, each sign with probability 1/2, and a run resumed with another DDP bucket layout
draws the same coins because segments are parameters, not buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..kernels.layout import GOLDEN, MASK64, SignSegments, as_signed, mix64, shift_right, words_for
from ..kernels.torch_ops import popcount64
from .faults import ByzantineFault
from .wire import FLAG_ZERO_LIST as ZERO_LIST
from .wire import FLAG_ZERO_PLANE as ZERO_PLANE
from .wire import FLAG_ZERO_RUNS as ZERO_RUNS
from .wire import Plan, with_extra

__all__ = ["EncodedRows", "MomentumStep", "SignEncoding", "zero_positions", "plane_from_positions", "zero_runs",
           "plane_from_runs", "call_key"]  # fmt: skip

ZEROS_SENT = ZERO_LIST | ZERO_PLANE | ZERO_RUNS

ZERO_COIN_SALT = 0x5A45524F434F494E  # "ZEROCOIN": the zero rule's coins differ from the tie coins


def zero_positions(nonzero: torch.Tensor) -> torch.Tensor:
    """int64 positions (ascending) of the clear bits of ``nonzero`` int64 [S] words."""
    words = (nonzero != -1).nonzero().view(-1)
    bits = torch.arange(64, device=nonzero.device)
    clear = ((~nonzero[words]).unsqueeze(1) >> bits) & 1  # [k_words, 64]
    return (words.unsqueeze(1) * 64 + bits)[clear.bool()]


def plane_from_positions(positions: torch.Tensor, words: int) -> torch.Tensor:
    """int64 [words] with every bit set but those at ``positions`` (distinct)."""
    cleared = torch.zeros(words, dtype=torch.int64, device=positions.device)
    # Distinct powers of two: their sum per word is their OR.
    cleared.index_add_(0, positions >> 6, torch.ones_like(positions) << (positions & 63))
    return ~cleared


def _run_starts(nonzero: torch.Tensor) -> torch.Tensor:
    """Bits set where a run of clear bits of ``nonzero`` [..., S] words begins (a row's first
    bit counts as following a set one)."""
    zero = ~nonzero
    before = zero << 1  # bit k: entry k-1 is zero (within the word)
    before[..., 1:] |= shift_right(zero[..., :-1], 63)  # bit 0: the previous word's last entry
    return zero.bitwise_and_(before.bitwise_not_())


def _run_ends(nonzero: torch.Tensor) -> torch.Tensor:
    """Bits set at the last bit of each run of clear bits (padding bits past the data are set)."""
    zero = ~nonzero
    carry = torch.cat([zero[..., 1:] << 63, torch.zeros_like(zero[..., :1])], dim=-1)
    return zero & ~(shift_right(zero, 1) | carry)


def zero_runs(nonzero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths), int64, of the runs of clear bits of ``nonzero`` int64 [S] words."""
    starts, ends = zero_positions(~_run_starts(nonzero)), zero_positions(~_run_ends(nonzero))
    return starts, ends - starts + 1


def _low_bits(k: torch.Tensor) -> torch.Tensor:
    """Per entry, an int64 with its ``k`` lowest bits set (0 <= k <= 64)."""
    return torch.where(k >= 64, -1, (torch.ones_like(k) << k.clamp(max=63)) - 1)


def plane_from_runs(starts: torch.Tensor, lengths: torch.Tensor, words: int) -> torch.Tensor:
    """int64 [words] with every bit set but those in the runs (disjoint, as :func:`zero_runs` gives)."""
    stops = starts + lengths  # exclusive
    first, last = starts >> 6, (stops - 1) >> 6
    top = (stops - 1 & 63) + 1  # bits of the last word inside its run
    one_word = first == last
    # Runs are disjoint, so their masks in a shared edge word have distinct bits: a sum is an OR.
    cleared = torch.zeros(words, dtype=torch.int64, device=starts.device)
    head = ~_low_bits(starts & 63) & torch.where(one_word, _low_bits(top), -1)
    cleared.index_add_(0, first, head)
    cleared.index_add_(0, last[~one_word], _low_bits(top[~one_word]))
    inner = torch.zeros(words + 1, dtype=torch.int64, device=starts.device)  # words wholly inside a run
    inner.index_add_(0, first[~one_word] + 1, torch.ones_like(first[~one_word]))
    inner.index_add_(0, last[~one_word], -torch.ones_like(last[~one_word]))
    return ~(cleared | torch.where(inner.cumsum(0)[:words] > 0, -1, 0))


def _run_words(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Runs as int32 (start, length) pairs, one int64 word each."""
    return torch.stack([starts, lengths], dim=1).to(torch.int32).view(torch.int64).reshape(-1)


def _runs_from_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = words.view(torch.int32).view(-1, 2).to(torch.int64)
    return pairs[:, 0], pairs[:, 1]


def _clear_bits(plane: torch.Tensor, lo: int, hi: int) -> None:
    """Clear bits ``lo .. hi-1`` of an int64 word plane."""
    first, last = lo >> 6, (hi - 1) >> 6
    low = lambda k: as_signed((1 << k) - 1)  # noqa: E731  the k lowest bits
    if first == last:
        plane[first] &= ~as_signed(((1 << (hi - lo)) - 1) << (lo & 63))
        return
    plane[first] &= low(lo & 63)
    plane[first + 1 : last] = 0
    plane[last] &= ~low(((hi - 1) & 63) + 1) if (hi & 63) else 0


def _list_words(positions: torch.Tensor) -> torch.Tensor:
    """Positions as int32 pairs in int64 words (an odd count padded with -1)."""
    as32 = positions.to(torch.int32)
    if as32.numel() % 2:
        as32 = torch.cat([as32, as32.new_full((1,), -1)])
    return as32.view(torch.int64)


def _list_positions(words: torch.Tensor) -> torch.Tensor:
    as32 = words.view(torch.int32)
    return as32[as32 >= 0].to(torch.int64)


def call_key(seed: int, step: int) -> int:
    """The 64-bit key of one call's tie-break coins."""
    return mix64((seed * GOLDEN + step) & MASK64)


@dataclass(frozen=True)
class MomentumStep:
    """Signum's momentum step, taken while packing: the voted tensor is the momentum buffer,
    advanced first by ``buf.lerp_(grad, weight)`` unless ``skip`` (the kernels' ``momentum_pack``,
    one pass on a GPU)."""

    grad: torch.Tensor  # flat, shaped like the buffer
    weight: float  # 1 - beta
    skip: torch.Tensor  # 0-d bool: the gradient holds NaN or Inf, the momentum stays


@dataclass
class EncodedRows:
    rows: torch.Tensor  # int64 [parts, S]
    codes: torch.Tensor  # int64 [parts]
    values: torch.Tensor  # int64 [parts]
    nonfinite: torch.Tensor | bool
    zero_planes: torch.Tensor | None  # int64 [parts, S], the source of the extras

    def extra(self, part: int, code: int) -> torch.Tensor:
        """The extra of ``part`` whose header code (already read by the exchange) is ``code``."""
        plane = self.zero_planes[part]
        if code & ZERO_PLANE:
            return plane
        return _run_words(*zero_runs(plane)) if code & ZERO_RUNS else _list_words(zero_positions(plane))


def _zero_codes(planes: torch.Tensor, words: int) -> torch.Tensor:
    """Per row of ``nonzero`` planes [P, S]: flag and extra length of the cheapest zero encoding."""
    zeros = popcount64(~planes).sum(dim=1)  # [P]
    runs = popcount64(_run_starts(planes)).sum(dim=1)
    list_len = (zeros + 1) // 2
    use_runs = (runs < list_len) & (runs < words)
    use_list = ~use_runs & (list_len < words)
    length = torch.where(use_runs, runs, torch.where(use_list, list_len, words))
    flag = torch.where(use_runs, ZERO_RUNS, torch.where(use_list, ZERO_LIST, ZERO_PLANE))
    return torch.where(zeros > 0, with_extra(flag, length), 0)


class SignEncoding:
    """The majority vote ``sign(sum_i sign(x_i))`` as an encoding for :class:`ExchangeWork`.

    Args:
        kernels: the kernel family (``kernels.kernels_for``).
        tie: ``"fast"`` or ``"exact"``.
        call_key: this call's tie-break key (:func:`call_key` of seed and step).
        segments: how the tensor splits into keyed pieces for the tie coins (default: one).
        fault: testing only: Byzantine ranks.
        first_entry: the tensor is entries ``first_entry ..`` of the one ``segments`` describe
            (a node-aware vote's slice), so its coins are those of the same entries voted whole.
        zeros: ``"abstain"`` or ``"coin"`` (``VoteConfig.zeros``).
        momentum: the tensor encoded is a momentum buffer to advance first (:class:`MomentumStep`).
    """

    __slots__ = ("kernels", "tie", "key", "segments", "fault", "first_entry", "zeros", "momentum")

    def __init__(
        self,
        kernels: ModuleType,
        tie: str,
        call_key: int,
        segments: SignSegments | None = None,
        fault: ByzantineFault | None = None,
        first_entry: int = 0,
        *,
        zeros: str = "abstain",
        momentum: MomentumStep | None = None,
    ) -> None:
        self.kernels, self.tie, self.key, self.segments, self.fault = kernels, tie, call_key, segments, fault
        self.first_entry, self.zeros, self.momentum = first_entry, zeros, momentum

    def plan(self, numel: int, world_size: int, rank: int, two_phase: bool) -> Plan:
        words = words_for(numel)
        if two_phase:
            shard = -(-words // world_size)
            return Plan(world_size, rank, numel, world_size, 64 * shard, shard, True)
        return Plan(world_size, rank, numel, 1, 64 * words, words, False)

    def encode(self, flat: torch.Tensor, plan: Plan) -> EncodedRows:
        step = self.momentum
        if step is not None:
            positive, nonzero, zeros, nonfinite = self.kernels.momentum_pack(
                flat, step.grad.view(-1), step.weight, step.skip, plan.parts * plan.words
            )
        else:
            positive, nonzero, zeros, nonfinite = self.kernels.pack(flat, plan.parts * plan.words)
        if self.zeros == "coin" and bool(zeros) and not bool(nonfinite):
            positive, nonzero, zeros = self._coins_for_zeros(positive, nonzero, flat.numel(), plan.rank)
        if self.fault is not None:
            positive = self.fault.corrupt(positive, nonzero, plan.rank, self.key & ((1 << 62) - 1))
        rows = positive.view(plan.parts, plan.words)
        planes = nonzero.view(plan.parts, plan.words)
        values = torch.zeros(plan.parts, dtype=torch.int64, device=flat.device)
        if isinstance(zeros, int) and zeros == 0:  # the dense case: no popcount pass
            return EncodedRows(rows, values, values, nonfinite, None)
        return EncodedRows(rows, _zero_codes(planes, plan.words), values, nonfinite, planes)

    def _coins_for_zeros(self, positive: torch.Tensor, nonzero: torch.Tensor, n: int, rank: int):
        """The planes with each exact zero voting this rank's coin, except in segments that are
        zero throughout here (they still abstain); and the zeros left. In words, not entries:
        a zero's positive bit is clear, so its coin is OR-ed in where ``nonzero`` is clear."""
        segments = self.segments or SignSegments.whole(self.first_entry + n)
        device = positive.device
        bounds = torch.tensor(segments.starts, device=device) - self.first_entry
        lo, hi = bounds[:-1].clamp(0, n), bounds[1:].clamp(0, n)  # each segment's part of this tensor
        # Nonzero entries below each bound, from the words (1/64 of the entries).
        counts = popcount64(nonzero)
        before = torch.cat([counts.new_zeros(1), counts.cumsum(0)])

        def nonzero_below(e: torch.Tensor) -> torch.Tensor:
            w, b = e >> 6, e & 63
            partial = nonzero[w.clamp(max=nonzero.numel() - 1)] & ((torch.ones_like(b) << b) - 1)
            return before[w] + popcount64(partial)

        blank = (hi > lo) & (nonzero_below(hi) == nonzero_below(lo))
        allowed = torch.full_like(nonzero, -1)  # entries that may vote a coin
        for a, b in torch.stack([lo[blank], hi[blank]], dim=1).tolist():  # usually none
            _clear_bits(allowed, a, b)
        key = mix64((self.key ^ ZERO_COIN_SALT) + (rank + 1) * GOLDEN & MASK64)  # per rank: independent coins
        bits = self.kernels.tie_words(segments, key, self.first_entry, words_for(n), device)
        coin_here = ~nonzero[: bits.numel()] & allowed[: bits.numel()]
        positive[: bits.numel()] |= bits & coin_here
        zeros = int((hi - lo)[blank].sum())
        return positive, nonzero | allowed, zeros

    def _planes(self, codes: list[int], extras: list, words: int, device) -> torch.Tensor | None:
        if not any(c & ZEROS_SENT for c in codes):
            return None
        planes = torch.full((len(codes), words), -1, dtype=torch.int64, device=device)
        for v, (code, extra) in enumerate(zip(codes, extras)):
            if code & ZERO_PLANE:
                planes[v] = extra
            elif code & ZERO_RUNS:
                planes[v] = plane_from_runs(*_runs_from_words(extra), words)
            elif code & ZERO_LIST:
                planes[v] = plane_from_positions(_list_positions(extra), words)
        return planes

    def reduce(self, rows, codes, values, extras, part, plan) -> EncodedRows:
        device = rows.device
        planes = self._planes(codes, extras, plan.words, device)
        dense = torch.tensor([not c & ZEROS_SENT for c in codes], dtype=torch.bool)
        tie = None
        if self.tie == "fast":
            segments = self.segments or SignSegments.whole(plan.numel)
            first = self.first_entry + part * plan.part_entries
            tie = self.kernels.tie_words(segments, self.key, first, plan.words, device)
        voted_pos, voted_nz = self.kernels.vote(rows, planes, dense, tie)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        can_have_zeros = planes is not None or (self.tie == "exact" and len(codes) % 2 == 0)
        if not can_have_zeros:
            return EncodedRows(voted_pos.unsqueeze(0), zero, zero, False, None)
        voted_planes = voted_nz.unsqueeze(0)
        return EncodedRows(voted_pos.unsqueeze(0), _zero_codes(voted_planes, plan.words), zero, False, voted_planes)

    def decode(self, rows, codes, values, extras, plan, out) -> None:
        flat = out.view(-1)
        positive = rows.reshape(-1)
        if not any(c & ZEROS_SENT for c in codes):
            self.kernels.unpack(positive, None, flat)
            return
        if not any(c & (ZERO_PLANE | ZERO_RUNS) for c in codes):  # only short lists: zero them after a dense unpack
            self.kernels.unpack(positive, None, flat)
            where = [_list_positions(e) + part * plan.part_entries for part, e in enumerate(extras) if e is not None]
            flat.index_fill_(0, torch.cat(where), 0)
            return
        planes = self._planes(codes, extras, plan.words, out.device).reshape(-1)
        self.kernels.unpack(positive, planes, flat)
