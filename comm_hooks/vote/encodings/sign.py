"""The sign encoding of the majority vote: what a shard holds, how it is voted and decoded.

A rank's shard of a tensor travels as its ``positive`` plane (one bit per entry). Exact zeros
(a rank abstains where its entry is 0) travel only when there are any, as the cheapest of a
zero list, zero runs (an embedding's rows of tokens absent from the batch, a dead unit's row)
and a zero plane (``zero_codes``), decided per rank and shard from the counts and announced in
the row's header (flag and length), so receivers size the extra transfer without a round trip. The voted shard's zeros
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

from ...kernels.bits import GOLDEN, MASK64, SignSegments, mix64, words_for
from ...kernels.torch_ops import popcount64
from .faults import ByzantineFault
from .wire import FLAG_ZERO_PLANE as ZERO_PLANE
from .wire import FLAG_ZERO_RUNS as ZERO_RUNS
from .wire import Plan
from .zero_codes import ZEROS_SENT, clear_bits, extra_of, list_positions, plane_of, zero_codes

__all__ = ["EncodedRows", "MomentumStep", "SignEncoding", "VoteCall", "call_key"]

ZERO_COIN_SALT = 0x5A45524F434F494E  # "ZEROCOIN": the zero rule's coins differ from the tie coins


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


@dataclass(frozen=True)
class VoteCall:
    """What one vote tells its encoding besides the config (the arguments of ``VoteWork``)."""

    step: int
    segments: SignSegments | None
    first_entry: int
    momentum: MomentumStep | None


@dataclass
class EncodedRows:
    rows: torch.Tensor  # int64 [parts, S]
    codes: torch.Tensor  # int64 [parts]
    values: torch.Tensor  # int64 [parts]
    nonfinite: torch.Tensor | bool
    zero_planes: torch.Tensor | None  # int64 [parts, S], the source of the extras

    def extra(self, part: int, code: int) -> torch.Tensor:
        """The extra of ``part`` whose header code (already read by the transport) is ``code``."""
        return extra_of(self.zero_planes[part], code)


class SignEncoding:
    """The majority vote ``sign(sum_i sign(x_i))`` as an encoding for :class:`TransportWork`.

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

    @classmethod
    def for_vote(cls, config, kernels: ModuleType, call: VoteCall) -> SignEncoding:
        """The encoding of one vote with ``config`` (a ``VoteConfig``): its tie and zero rules,
        coins keyed by its seed and the call's step, its faults."""
        return cls(
            kernels,
            config.tie,
            call_key(config.seed, call.step),
            call.segments,
            config.fault,
            call.first_entry,
            zeros=config.zeros,
            momentum=call.momentum,
        )

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
        return EncodedRows(rows, zero_codes(planes, plan.words), values, nonfinite, planes)

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
            clear_bits(allowed, a, b)
        key = mix64((self.key ^ ZERO_COIN_SALT) + (rank + 1) * GOLDEN & MASK64)  # per rank: independent coins
        bits = self.kernels.tie_words(segments, key, self.first_entry, words_for(n), device)
        coin_here = ~nonzero[: bits.numel()] & allowed[: bits.numel()]
        positive[: bits.numel()] |= bits & coin_here
        zeros = int((hi - lo)[blank].sum())
        return positive, nonzero | allowed, zeros

    def _planes(self, codes: list[int], extras: list, words: int, device) -> torch.Tensor | None:
        if not any(c & ZEROS_SENT for c in codes):
            return None
        return torch.stack([plane_of(code, extra, words, device) for code, extra in zip(codes, extras)])

    def reduce(self, rows, codes, values, extras, part, plan) -> EncodedRows:
        device = rows.device
        planes = self._planes(codes, extras, plan.words, device)
        dense = [not c & ZEROS_SENT for c in codes]
        tie = None
        if self.tie == "fast" and (len(codes) % 2 == 0 or planes is not None):  # odd M without zeros: no ties
            segments = self.segments or SignSegments.whole(plan.numel)
            first = self.first_entry + part * plan.part_entries
            tie = self.kernels.tie_words(segments, self.key, first, plan.words, device)
        voted_pos, voted_nz = self.kernels.vote(rows, planes, dense, tie)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        can_have_zeros = planes is not None or (self.tie == "exact" and len(codes) % 2 == 0)
        if not can_have_zeros:
            return EncodedRows(voted_pos.unsqueeze(0), zero, zero, False, None)
        voted_planes = voted_nz.unsqueeze(0)
        return EncodedRows(voted_pos.unsqueeze(0), zero_codes(voted_planes, plan.words), zero, False, voted_planes)

    def plain_result(self, codes: list[int]) -> bool:
        """No tie can vote 0 (``"fast"`` ties, or an odd number of voters): with no zeros sent,
        the voted shards are plain signs everywhere."""
        return self.tie == "fast" or len(codes) % 2 == 1

    def decode(self, rows, codes, values, extras, plan, out) -> None:
        flat = out.view(-1)
        positive = rows.reshape(-1)
        if not any(c & ZEROS_SENT for c in codes):
            self.kernels.unpack(positive, None, flat)
            return
        if not any(c & (ZERO_PLANE | ZERO_RUNS) for c in codes):  # only short lists: zero them after a dense unpack
            self.kernels.unpack(positive, None, flat)
            where = []
            for part, e in enumerate(extras):
                if e is not None:  # a list's padding (-1, at its end) repeats its first position
                    positions = list_positions(e)
                    where.append(torch.where(positions >= 0, positions, positions[0]) + part * plan.part_entries)
            flat.index_fill_(0, torch.cat(where), 0)
            return
        planes = self._planes(codes, extras, plan.words, out.device).reshape(-1)
        self.kernels.unpack(positive, planes, flat)
