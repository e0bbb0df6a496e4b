"""The 1-bit majority-vote collective: every rank ends with ``sign(sum_i sign(v_i))``.

Wire protocol (M ranks, n entries, W = ceil(n/64) words of packed signs):

* **Two-phase** (M >= 3): the packed ``positive`` plane is cut into M shards of
  S = ceil(W/M) words; each shard travels with one header word of flags.
  1. all-to-all: rank r receives shard r (and its flags) from every rank;
  2. rank r votes its shard in the packed domain (:func:`vote_packed`);
  3. all-gather of the voted shards (again with a flags word);
  4. each rank unpacks once into the output.
  Bytes sent per rank, dense case: ``2 * (M-1) * (S+1) * 8 <= 2(M-1)/M * ceil(n/8) + 32(M-1)``.
* **All-gather** (M = 2, where it costs the same bytes in one round): every rank gathers
  every packed vector and votes all of it locally; ``(M-1) * (W+1) * 8`` bytes.
* M = 1 sends nothing.

Zeros. The header flags say whether the sender's tensor has an exact zero. Only then do the
``nonzero`` planes travel: in an extra all-to-all from just the ranks that have zeros
(+(M-1)/M * n/8 bytes for each such rank, n/8 on the all-gather path), and, if the voted
result itself has zeros, an extra all-gather of the voted ``nonzero`` plane
(+(M-1)/M * n/8 bytes). So in the dense case the wire stays at one bit per entry, and the
worst case is two bits per entry.

Ties (only for even M) are 0 in ``"exact"`` mode. In exact mode with even M a voted zero is
likely, so the second all-gather usually runs (1.5 bits per entry on the two-phase path; the
M = 2 all-gather path is unaffected). In ``"fast"`` mode a tie between nonzero voters becomes
+1 or -1 from a generator seeded from ``seed`` (the same on every rank): each with
probability 1/2, so the vote stays an unbiased estimate of the tie, and the output stays at
one bit. ``"exact"`` is the default because it is the definition in the design (and the
output of one code path does not depend on the world size being odd); choose ``"fast"``
with an even world size to keep the wire at one bit.

Padding: pad bits are set in both planes on every rank, so they vote +1 and can neither
raise a zero flag nor leak into the result (which is cut to n entries).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from .packing import has_zero, pack_nonzero, pack_signs, packed_size, unpack_signs
from .vote import vote_packed

__all__ = ["CommStats", "majority_vote", "majority_vote_async", "vote_bytes_per_rank", "TIE_MODES", "ALGORITHMS"]

TIE_MODES = ("exact", "fast")
ALGORITHMS = ("auto", "two_phase", "all_gather")
_WORD = 8  # bytes
_HAS_ZERO = 1  # header flag bit


class CommStats:
    """Bytes a rank sent and received through the vote collective (and the hook's all-reduces)."""

    __slots__ = ("calls", "bytes_sent", "bytes_received")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def add(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, int(state[name]))

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, bytes_sent={self.bytes_sent}, bytes_received={self.bytes_received})"


def _group_size_rank(group) -> tuple[int, int]:
    # One code path for one and many ranks: without an initialised process group we are alone.
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _choose_algorithm(algorithm: str, world_size: int) -> str:
    if algorithm == "auto":
        return "all_gather" if world_size <= 2 else "two_phase"
    return algorithm


def vote_bytes_per_rank(numel: int, world_size: int, algorithm: str = "auto") -> int:
    """Bytes one rank sends per dense-case call (no zeros, no ties): the collective's formula."""
    if world_size == 1:
        return 0
    words = -(-numel // 64)
    if _choose_algorithm(algorithm, world_size) == "all_gather":
        return (world_size - 1) * (words + 1) * _WORD
    shard = -(-words // world_size)
    return 2 * (world_size - 1) * (shard + 1) * _WORD


def _padded_words(packed: torch.Tensor, numel: int, words: int) -> torch.Tensor:
    """uint8 packed bits -> int64 [words], every bit at or past ``numel`` set."""
    buf = torch.full((words * _WORD,), 0xFF, dtype=torch.uint8, device=packed.device)
    nbytes = packed_size(numel)
    buf[:nbytes] = packed[:nbytes]
    if numel % 8:
        buf[nbytes - 1] |= (0xFF << (numel % 8)) & 0xFF
    return buf.view(torch.int64)


def _tie_bits(seed: int, shard: int, words: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 0x9E3779B1 + shard * 0x85EBCA77 + 1) % (1 << 63))
    raw = torch.randint(0, 256, (words * _WORD,), dtype=torch.uint8, generator=gen, device=device)
    return raw.view(torch.int64)


def _with_header(flags: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """[rows, 1 + S] int64: a flags word ahead of each row of payload [rows, S]."""
    rows = payload.shape[0]
    return torch.cat([flags.to(torch.int64).expand(rows).unsqueeze(1), payload], dim=1)


def _check_inputs(tensor: torch.Tensor, tie: str, algorithm: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError("tensor is sparse; the majority vote needs dense gradients (sparse gradients are not supported)")
    if not tensor.is_floating_point():
        raise ValueError(f"tensor has dtype {tensor.dtype}; the majority vote needs a floating-point tensor")
    if tie not in TIE_MODES:
        raise ValueError(f"tie={tie!r} is not a tie mode; use one of {TIE_MODES}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {ALGORITHMS}")


def majority_vote_async(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    tie: Literal["exact", "fast"] = "exact",
    seed: int = 0,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    algorithm: Literal["auto", "two_phase", "all_gather"] = "auto",
) -> torch.futures.Future[torch.Tensor]:
    """Start the vote; the returned future holds the voted tensor (see :func:`majority_vote`).

    The first collective starts before this returns, so packing and the first exchange
    overlap with whatever the caller does next (the backward pass, in a DDP hook).
    """
    _check_inputs(tensor, tie, algorithm)
    if out is None:
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    elif out.shape != tensor.shape or not out.is_contiguous() or not out.is_floating_point():
        raise ValueError(f"out must be a contiguous float tensor shaped {tuple(tensor.shape)}")
    world_size, rank = _group_size_rank(group)
    numel = tensor.numel()
    words = max(1, -(-numel // 64))
    algorithm = _choose_algorithm(algorithm, world_size)
    if stats is not None:
        stats.calls += 1

    # Pack locally: [words] int64 positive plane, and the zero flag (a tensor: no CUDA sync).
    flat = tensor.detach().reshape(-1)
    zero_flag = has_zero(flat).to(device=flat.device, dtype=torch.int64) * _HAS_ZERO
    positive = _padded_words(pack_signs(flat), numel, words)

    def nonzero_plane() -> torch.Tensor:
        return _padded_words(pack_nonzero(flat), numel, words)

    def unpack(pos_words: torch.Tensor, nz_words: torch.Tensor) -> torch.Tensor:
        # Skip the nonzero plane when it is all ones (the dense case): half the unpack cost.
        as_bytes = lambda w: w.contiguous().view(-1).view(torch.uint8)  # noqa: E731
        nonzero = as_bytes(nz_words) if bool((~nz_words).any()) else None
        unpack_signs(as_bytes(pos_words), numel, nonzero=nonzero, out=out.view(-1))
        return out

    def account(sent: int, received: int) -> None:
        if stats is not None:
            stats.add(sent, received)

    if world_size == 1:
        nz = nonzero_plane().unsqueeze(0) if bool(zero_flag) else None
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(unpack(*vote_packed(positive.unsqueeze(0), nz)))
        return fut

    if algorithm == "all_gather":
        send = _with_header(zero_flag, positive.unsqueeze(0)).squeeze(0)  # [1 + W]
        gathered = send.new_empty(world_size, words + 1)
        work = dist.all_gather(list(gathered.unbind(0)), send, group=group, async_op=True)
        account((world_size - 1) * send.numel() * _WORD, (world_size - 1) * send.numel() * _WORD)

        def finish_all_gather(_: torch.futures.Future) -> torch.Tensor:
            flags = gathered[:, 0].tolist()
            nz = None
            if any(f & _HAS_ZERO for f in flags):
                nz = positive.new_empty(world_size, words)
                dist.all_gather(list(nz.unbind(0)), nonzero_plane(), group=group)
                account((world_size - 1) * words * _WORD, (world_size - 1) * words * _WORD)
            tie_break = _tie_bits(seed, 0, words, flat.device) if tie == "fast" else None
            return unpack(*vote_packed(gathered[:, 1:], nz, tie_break=tie_break))

        return work.get_future().then(finish_all_gather)

    # Two-phase: shards of S words, each sent with a flags word.
    shard = -(-words // world_size)
    padded = torch.full((shard * world_size,), -1, dtype=torch.int64, device=flat.device)
    padded[:words] = positive
    send = _with_header(zero_flag, padded.view(world_size, shard))  # [M, 1 + S]
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    row_bytes = (shard + 1) * _WORD
    account((world_size - 1) * row_bytes, (world_size - 1) * row_bytes)

    def finish_two_phase(_: torch.futures.Future) -> torch.Tensor:
        flags = recv[:, 0].tolist()
        zero_ranks = [i for i, f in enumerate(flags) if f & _HAS_ZERO]
        nz = None
        if zero_ranks:
            # Only ranks with zeros send their nonzero shards; everyone else counts as all-ones.
            mine = rank in zero_ranks
            nz_send = torch.full((shard * world_size,), -1, dtype=torch.int64, device=flat.device)
            if mine:
                nz_send[:words] = nonzero_plane()
            nz_recv = positive.new_empty(len(zero_ranks) * shard)
            dist.all_to_all_single(
                nz_recv,
                nz_send if mine else nz_send[:0],
                output_split_sizes=[shard if i in zero_ranks else 0 for i in range(world_size)],
                input_split_sizes=[shard if mine else 0] * world_size,
                group=group,
            )
            nz = torch.full((world_size, shard), -1, dtype=torch.int64, device=flat.device)
            nz[zero_ranks] = nz_recv.view(len(zero_ranks), shard)
            others_with_zeros = len(zero_ranks) - int(mine)
            account((world_size - 1) * shard * _WORD if mine else 0, others_with_zeros * shard * _WORD)
        tie_break = _tie_bits(seed, rank, shard, flat.device) if tie == "fast" else None
        voted_pos, voted_nz = vote_packed(recv[:, 1:], nz, tie_break=tie_break)
        voted_zero_flag = (~voted_nz != 0).any().to(torch.int64) * _HAS_ZERO
        mine_out = _with_header(voted_zero_flag, voted_pos.unsqueeze(0)).squeeze(0)
        gathered = mine_out.new_empty(world_size, shard + 1)
        dist.all_gather(list(gathered.unbind(0)), mine_out, group=group)
        account((world_size - 1) * row_bytes, (world_size - 1) * row_bytes)
        gathered_nz = positive.new_full((world_size, shard), -1)
        if any(f & _HAS_ZERO for f in gathered[:, 0].tolist()):
            dist.all_gather(list(gathered_nz.unbind(0)), voted_nz, group=group)
            account((world_size - 1) * shard * _WORD, (world_size - 1) * shard * _WORD)
        return unpack(gathered[:, 1:], gathered_nz)

    return work.get_future().then(finish_two_phase)


def majority_vote(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    tie: Literal["exact", "fast"] = "exact",
    seed: int = 0,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    algorithm: Literal["auto", "two_phase", "all_gather"] = "auto",
) -> torch.Tensor:
    """``sign(sum_i sign(tensor_i))`` over the ranks of ``group`` (None = WORLD), on every rank.

    Args:
        tensor: float tensor (fp32, bf16, fp16, fp64) of any shape, same shape on every rank.
        group: process group; without an initialised default group the caller is alone (M=1).
        tie: ``"exact"`` (ties vote 0) or ``"fast"`` (ties vote a seeded, unbiased ±1); see the
            module docstring for what each costs on the wire.
        seed: tie-break seed, which must be equal on every rank (vary it per call).
        out: contiguous float tensor shaped like ``tensor`` to write into (may be ``tensor``).
        stats: a :class:`CommStats` the bytes sent and received are added to.
        algorithm: ``"auto"`` (all-gather for M <= 2, two-phase above), or force one.

    Returns:
        the voted tensor, entries in {-1, 0, +1}, in ``tensor``'s dtype (or ``out``).
    """
    return majority_vote_async(
        tensor, group, tie=tie, seed=seed, out=out, stats=stats, algorithm=algorithm
    ).wait()
