"""The sign encoding of the majority vote: what a shard holds, how it is voted and decoded.

A rank's shard of a tensor travels as its ``positive`` plane (one bit per entry). Exact zeros
(a rank abstains where its entry is 0) travel only when there are any, as the cheaper of:

* a **zero list**: the positions of the zeros inside the shard, 32 bits each
  (``ceil(k/2)`` words for k zeros), while ``ceil(k/2) < S``;
* a **zero plane**: the shard's ``nonzero`` plane, ``S`` words,

decided per rank and shard from the counts, and announced in the row's header (flag and
length), so receivers size the extra exchange without a round trip. The voted shard's zeros
(entries that are 0 on every voter, and ties in ``"exact"`` mode) travel back the same way.
So a tensor with k zeros costs ``O(k)`` bytes more than the dense formula while k is small,
and never more than a second bit plane.

Ties (even numbers of voters) in ``"fast"`` mode take the bit of a hash of (seed, step,
segment key, index inside the segment) (``kernels.reference.tie_bit``): every rank draws the
same coin, each sign with probability 1/2, and a run resumed with another DDP bucket layout
draws the same coins because segments are parameters, not buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from .exchange import Plan
from .faults import ByzantineFault
from .kernels import reference
from .kernels.layout import MASK64, SignSegments, words_for

__all__ = ["ScaledSignEncoding", "SignEncoding", "scaled_sign", "ZERO_LIST", "ZERO_PLANE", "popcount64", "zero_positions", "plane_from_positions", "call_key"]

ZERO_LIST = 2  # header flag bits (bit 0 belongs to the exchange)
ZERO_PLANE = 4


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits per int64 word (SWAR; int64 arithmetic wraps like the unsigned definition)."""
    x = x - (_shr(x, 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + (_shr(x, 2) & 0x3333333333333333)
    x = (x + _shr(x, 4)) & 0x0F0F0F0F0F0F0F0F
    return _shr(x * 0x0101010101010101, 56)


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
    return reference.mix64((seed * 0x9E3779B97F4A7C15 + step) & MASK64)


@dataclass
class _Encoded:
    rows: torch.Tensor  # int64 [parts, S]
    codes: torch.Tensor  # int64 [parts]
    values: torch.Tensor  # int64 [parts]
    nonfinite: torch.Tensor | bool
    zero_planes: torch.Tensor | None  # int64 [parts, S], the source of the extras

    def extra(self, part: int, code: int) -> torch.Tensor:
        """The extra of ``part`` whose header code (already read by the exchange) is ``code``."""
        plane = self.zero_planes[part]
        return plane if code & ZERO_PLANE else _list_words(zero_positions(plane))


def _zero_codes(planes: torch.Tensor, words: int) -> torch.Tensor:
    """Per row of ``nonzero`` planes [P, S]: flag and extra length of the cheaper zero encoding."""
    zeros = popcount64(~planes).sum(dim=1)  # [P]
    list_len = (zeros + 1) // 2
    use_list = list_len < words
    length = torch.where(use_list, list_len, words)
    flag = torch.where(use_list, ZERO_LIST, ZERO_PLANE)
    return torch.where(zeros > 0, flag | (length << 8), 0)


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
    """

    __slots__ = ("kernels", "tie", "key", "segments", "fault", "first_entry")

    def __init__(
        self,
        kernels: ModuleType,
        tie: str,
        call_key: int,
        segments: SignSegments | None = None,
        fault: ByzantineFault | None = None,
        first_entry: int = 0,
    ) -> None:
        self.kernels, self.tie, self.key, self.segments, self.fault = kernels, tie, call_key, segments, fault
        self.first_entry = first_entry

    def plan(self, numel: int, world_size: int, rank: int, two_phase: bool) -> Plan:
        words = words_for(numel)
        if two_phase:
            shard = -(-words // world_size)
            return Plan(world_size, rank, numel, world_size, 64 * shard, shard, True)
        return Plan(world_size, rank, numel, 1, 64 * words, words, False)

    def encode(self, flat: torch.Tensor, plan: Plan) -> _Encoded:
        positive, nonzero, zeros, nonfinite = self.kernels.pack(flat, plan.parts * plan.words)
        if self.fault is not None:
            positive = self.fault.corrupt(positive, nonzero, plan.rank, self.key & ((1 << 62) - 1))
        rows = positive.view(plan.parts, plan.words)
        planes = nonzero.view(plan.parts, plan.words)
        values = torch.zeros(plan.parts, dtype=torch.int64, device=flat.device)
        if isinstance(zeros, int) and zeros == 0:  # the dense case: no popcount pass
            return _Encoded(rows, values, values, nonfinite, None)
        return _Encoded(rows, _zero_codes(planes, plan.words), values, nonfinite, planes)

    def _planes(self, codes: list[int], extras: list, words: int, device) -> torch.Tensor | None:
        if not any(c & (ZERO_LIST | ZERO_PLANE) for c in codes):
            return None
        planes = torch.full((len(codes), words), -1, dtype=torch.int64, device=device)
        for v, (code, extra) in enumerate(zip(codes, extras)):
            if code & ZERO_PLANE:
                planes[v] = extra
            elif code & ZERO_LIST:
                planes[v] = plane_from_positions(_list_positions(extra), words)
        return planes

    def reduce(self, rows, codes, values, extras, part, plan) -> _Encoded:
        device = rows.device
        planes = self._planes(codes, extras, plan.words, device)
        dense = torch.tensor([not c & (ZERO_LIST | ZERO_PLANE) for c in codes], dtype=torch.bool)
        tie = None
        if self.tie == "fast":
            segments = self.segments or SignSegments.whole(plan.numel)
            first = self.first_entry + part * plan.part_entries
            tie = self.kernels.tie_words(segments, self.key, first, plan.words, device)
        voted_pos, voted_nz = self.kernels.vote(rows, planes, dense, tie)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        can_have_zeros = planes is not None or (self.tie == "exact" and len(codes) % 2 == 0)
        if not can_have_zeros:
            return _Encoded(voted_pos.unsqueeze(0), zero, zero, False, None)
        voted_planes = voted_nz.unsqueeze(0)
        return _Encoded(voted_pos.unsqueeze(0), _zero_codes(voted_planes, plan.words), zero, False, voted_planes)

    def decode(self, rows, codes, values, extras, plan, out) -> None:
        flat = out.view(-1)
        positive = rows.reshape(-1)
        if not any(c & (ZERO_LIST | ZERO_PLANE) for c in codes):
            self.kernels.unpack(positive, None, flat)
            return
        if not any(c & ZERO_PLANE for c in codes):  # only short lists: zero them after a dense unpack
            self.kernels.unpack(positive, None, flat)
            where = [_list_positions(e) + part * plan.part_entries for part, e in enumerate(extras) if e is not None]
            flat.index_fill_(0, torch.cat(where), 0)
            return
        planes = self._planes(codes, extras, plan.words, out.device).reshape(-1)
        self.kernels.unpack(positive, planes, flat)


def scaled_sign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, signs): ``scale = ||x|| / sqrt(n)`` and signs in {-1, +1}, with sign(0) = +1.

    ``scale * signs`` has x's RMS (1-bit Adam's compression). Should the norm overflow for
    finite input (entries near the dtype's maximum), it is taken of ``x / max|x|`` instead.
    """
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    if not bool(torch.isfinite(scale)) and bool(torch.isfinite(x).all()):
        peak = x.abs().max()
        scale = torch.linalg.vector_norm(x / peak) * (peak / math.sqrt(x.numel()))
    signs = x.ge(0).to(x.dtype).mul_(2).sub_(1)
    return scale, signs


class ScaledSignEncoding:
    """Error-feedback scaled sign (1-bit Adam's compression) as an encoding: each rank sends
    ``scale * sign(x + worker_error)`` with ``scale = ||x + worker_error|| / sqrt(n)`` and keeps
    the residual as its new worker error; the server part averages the M senders'
    ``scale_i * sign_i``, compresses again with its own error feedback, and every rank decodes
    ``scale_r * sign_r`` per part. ``sign(0) = +1``. The scale travels in the header's value word.

    Args:
        kernels: the kernel family.
        worker_error: this rank's feedback buffer, as long as the encoded tensor (updated in ``encode``).
        server_error: this rank's feedback buffer for its part (updated in ``reduce``).
    """

    __slots__ = ("kernels", "worker_error", "server_error")

    def __init__(self, kernels: ModuleType, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        self.kernels, self.worker_error, self.server_error = kernels, worker_error, server_error

    def plan(self, numel: int, world_size: int, rank: int, two_phase: bool) -> Plan:
        chunk = numel // world_size
        return Plan(world_size, rank, numel, world_size, chunk, words_for(chunk), True)

    def _signs_rows(self, rows: torch.Tensor, words: int) -> torch.Tensor:
        """int64 [R, words]: bit set where the entry is >= 0 (NaN counts as negative)."""
        packed = []
        for row in rows:
            positive, nonzero, _, _ = self.kernels.pack(row.contiguous(), words)
            packed.append(positive | ~nonzero)
        return torch.stack(packed)

    def _unpack(self, row: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=row.device)
        self.kernels.unpack(row, None, out)
        return out

    def encode(self, flat: torch.Tensor, plan: Plan) -> _Encoded:
        flat = flat + self.worker_error
        scale, signs = scaled_sign(flat)
        self.worker_error.copy_(flat - scale * signs)
        rows = self._signs_rows(flat.view(plan.parts, plan.part_entries), plan.words)
        scale = scale.to(torch.float64).reshape(1).view(torch.int64).expand(plan.parts)
        codes = torch.zeros(plan.parts, dtype=torch.int64, device=flat.device)
        return _Encoded(rows, codes, scale.contiguous(), ~torch.isfinite(flat).all(), None)

    def reduce(self, rows, codes, values, extras, part, plan) -> _Encoded:
        dtype = self.server_error.dtype
        scales = torch.tensor(values, dtype=torch.int64).view(torch.float64).to(dtype=dtype, device=rows.device)
        signs = torch.stack([self._unpack(row, plan.part_entries, dtype) for row in rows])  # [M, chunk]
        server = (signs * (scales / plan.world_size).unsqueeze(1)).sum(dim=0)
        server.add_(self.server_error)
        scale, server_signs = scaled_sign(server)
        self.server_error.copy_(server - scale * server_signs)
        zero = torch.zeros(1, dtype=torch.int64, device=rows.device)
        value = scale.to(torch.float64).reshape(1).view(torch.int64)
        return _Encoded(self._signs_rows(server.unsqueeze(0), plan.words), zero, value, False, None)

    def decode(self, rows, codes, values, extras, plan, out) -> None:
        flat = out.view(-1)
        scales = torch.tensor(values, dtype=torch.int64).view(torch.float64).tolist()
        for r, (row, scale) in enumerate(zip(rows, scales)):
            part = flat[r * plan.part_entries : (r + 1) * plan.part_entries]
            self.kernels.unpack(row, None, part)
            part.mul_(torch.tensor(scale, dtype=flat.dtype))
