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
one bit. The tie bits follow the tensor's layout, so a DDP run resumed from a checkpoint
(whose first iteration uses DDP's initial buckets) draws different ones: fast mode is
reproducible within a run, exact mode also across a resume. ``"exact"`` is the default
because it is the definition in the design (and the output of one code path does not
depend on the world size being odd); choose ``"fast"`` with an even world size to keep the
wire at one bit.

Padding: pad bits are set in both planes on every rank, so they vote +1 and can neither
raise a zero flag nor leak into the result (which is cut to n entries).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from .faults import ByzantineFault
from .packing import pack_planes_checked, packed_size, unpack_signs
from .vote import vote_packed

__all__ = ["CommStats", "NonFiniteError", "VoteWork", "majority_vote", "NONFINITE_ACTIONS", "majority_vote_async", "vote_bytes_per_rank", "TIE_MODES", "ALGORITHMS"]

TIE_MODES = ("exact", "fast")
ALGORITHMS = ("auto", "two_phase", "all_gather")
_WORD = 8  # bytes
_HAS_ZERO = 1  # header flag bits
_NONFINITE = 2
NONFINITE_ACTIONS = ("skip", "raise")


class NonFiniteError(RuntimeError):
    """Some rank's tensor held NaN or Inf; raised on every rank alike (``nonfinite="raise"``)."""


class CommStats:
    """Calls, bytes sent and received, and calls skipped for non-finite input."""

    __slots__ = ("calls", "bytes_sent", "bytes_received", "skipped")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.skipped = 0

    def add(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, int(state.get(name, 0)))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"CommStats({fields})"


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


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: does ``tensor`` hold NaN or ±Inf?

    One summing pass (about half a memcpy): a sum is finite when every entry is, and an
    infinite sum of finite entries (overflow) is rare enough to settle with the entry-wise
    check only then. fp16 sums in float32, whose range its values cannot overflow.
    """
    total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
    bad = ~torch.isfinite(total)
    if bool(bad):
        bad = ~torch.isfinite(tensor).all()
    return bad


def _check_inputs(tensor: torch.Tensor, tie: str, algorithm: str, nonfinite: str = "skip") -> None:
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
    if nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(f"nonfinite={nonfinite!r} is not an action; use one of {NONFINITE_ACTIONS}")


class VoteWork:
    """One majority vote in flight, advanced in three stages by its caller.

    ``VoteWork(...)`` packs and starts the first exchange; :meth:`exchange` waits for it, votes
    the local shard and starts the second; :meth:`wait` finishes and returns the voted tensor.
    Every collective is issued by the thread that calls these methods, in call order. That is
    what keeps ranks matched: gloo pairs collectives by issue order, so a collective issued
    from a future's callback thread could pair with a different one on another rank. A DDP
    hook interleaves the stages of consecutive buckets to overlap them with backward.

    Non-finite input: each rank's first header word also says whether its tensor holds NaN or
    Inf, so after the first exchange every rank knows which ranks had any, at no extra round
    trip. Then all of them skip the rest: the result is all zeros (no entry moves) and
    ``stats.skipped`` counts it, or with ``nonfinite="raise"`` all raise :class:`NonFiniteError`
    naming those ranks and ``label``.
    """

    __slots__ = (
        "_group", "_world_size", "_rank", "_tie", "_seed", "_stats", "_algorithm", "_nonfinite", "_label",
        "_device", "_out", "_numel", "_words", "_shard", "_positive", "_nonzero",
        "_recv", "_work", "_voted", "_stage", "_skipped",
    )  # fmt: skip

    def __init__(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        tie: str = "exact",
        seed: int = 0,
        out: torch.Tensor | None = None,
        stats: CommStats | None = None,
        algorithm: str = "auto",
        nonfinite: str = "skip",
        label: str = "",
        fault: ByzantineFault | None = None,
    ) -> None:
        _check_inputs(tensor, tie, algorithm, nonfinite)
        if out is None:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        elif out.shape != tensor.shape or not out.is_contiguous() or not out.is_floating_point():
            raise ValueError(f"out must be a contiguous float tensor shaped {tuple(tensor.shape)}")
        self._group = group
        self._world_size, self._rank = _group_size_rank(group)
        self._tie, self._seed, self._stats, self._out = tie, seed, stats, out
        self._nonfinite, self._label, self._skipped = nonfinite, label, False
        self._algorithm = _choose_algorithm(algorithm, self._world_size)
        self._numel = tensor.numel()
        self._device = tensor.device
        self._words = max(1, -(-self._numel // 64))
        self._shard = -(-self._words // self._world_size)
        if stats is not None:
            stats.calls += 1

        # Pack both planes in one pass: [W] int64 each. The nonzero plane only travels if some
        # rank has a zero; the flag stays a tensor (no CUDA sync here).
        positive, nonzero, nonfinite_input = pack_planes_checked(tensor)
        self._positive = _padded_words(positive, self._numel, self._words)
        self._nonzero = _padded_words(nonzero, self._numel, self._words)
        if fault is not None:  # testing only: this rank may be Byzantine
            self._positive = fault.corrupt(self._positive, self._nonzero, self._rank, seed)
        zero_flag = (~self._nonzero).any().to(torch.int64) * _HAS_ZERO
        zero_flag = zero_flag | nonfinite_input.to(device=zero_flag.device, dtype=torch.int64) * _NONFINITE
        self._voted: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stage = 0
        M, S = self._world_size, self._shard
        if M == 1:
            self._recv = _with_header(zero_flag, self._positive.unsqueeze(0))  # [1, 1 + W]
            self._work = None
        elif self._algorithm == "all_gather":
            send = _with_header(zero_flag, self._positive.unsqueeze(0)).squeeze(0)  # [1 + W]
            self._recv = send.new_empty(M, self._words + 1)
            self._work = dist.all_gather(list(self._recv.unbind(0)), send, group=group, async_op=True)
            self._account((M - 1) * send.numel(), (M - 1) * send.numel())
        else:
            padded = self._positive.new_full((S * M,), -1)
            padded[: self._words] = self._positive
            send = _with_header(zero_flag, padded.view(M, S))  # [M, 1 + S]: row r goes to rank r
            self._recv = torch.empty_like(send)
            self._work = dist.all_to_all_single(self._recv, send, group=group, async_op=True)
            self._account((M - 1) * (S + 1), (M - 1) * (S + 1))

    def _account(self, sent_words: int, received_words: int) -> None:
        if self._stats is not None:
            self._stats.add(sent_words * _WORD, received_words * _WORD)

    def _exchange_nonzero(self, zero_ranks: list[int]) -> torch.Tensor:
        """[M, S] nonzero planes of this rank's shard; only ranks that have zeros send theirs."""
        M, S, rank = self._world_size, self._shard, self._rank
        mine = rank in zero_ranks
        send = self._positive.new_full((S * M if mine else 0,), -1)
        if mine:
            send[: self._words] = self._nonzero
        recv = self._positive.new_empty(len(zero_ranks) * S)
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[S if i in zero_ranks else 0 for i in range(M)],
            input_split_sizes=[S if mine else 0] * M,
            group=self._group,
        )
        self._account((M - 1) * S if mine else 0, (len(zero_ranks) - int(mine)) * S)
        planes = self._positive.new_full((M, S), -1)  # ranks without zeros: all nonzero
        planes[zero_ranks] = recv.view(len(zero_ranks), S)
        return planes

    def exchange(self) -> None:
        """Wait for the first exchange, vote this rank's part, start the second exchange."""
        if self._stage >= 1:
            return
        if self._work is not None:
            self._work.wait()
        M, W, S = self._world_size, self._words, self._shard
        flags = self._recv[:, 0].tolist()
        bad_ranks = [i for i, f in enumerate(flags) if f & _NONFINITE]
        if bad_ranks:  # every rank sees the same flags, so all take this branch together
            self._stage, self._skipped = 1, True
            if self._stats is not None:
                self._stats.skipped += 1
            if self._nonfinite == "raise":
                raise NonFiniteError(f"NaN or Inf in {self._label or 'the voted tensor'} on rank(s) {bad_ranks}")
            return
        zero_ranks = [i for i, f in enumerate(flags) if f & _HAS_ZERO]
        two_phase = M > 1 and self._algorithm == "two_phase"
        nz = None
        if zero_ranks and two_phase:
            nz = self._exchange_nonzero(zero_ranks)
        elif zero_ranks and M > 1:
            nz = self._positive.new_empty(M, W)
            dist.all_gather(list(nz.unbind(0)), self._nonzero, group=self._group)
            self._account((M - 1) * W, (M - 1) * W)
        elif zero_ranks:
            nz = self._nonzero.unsqueeze(0)
        tie_break = None
        if self._tie == "fast":
            # Seeded by (seed, shard index): each shard is voted once, every rank agrees.
            part = self._rank if two_phase else 0
            tie_break = _tie_bits(self._seed, part, S if two_phase else W, self._device)
        voted_pos, voted_nz = vote_packed(self._recv[:, 1:], nz, tie_break=tie_break)  # [S] or [W]
        if two_phase:
            voted_zero = (~voted_nz).any().to(torch.int64) * _HAS_ZERO
            send = _with_header(voted_zero, voted_pos.unsqueeze(0)).squeeze(0)  # [1 + S]
            self._recv = send.new_empty(M, S + 1)
            self._work = dist.all_gather(list(self._recv.unbind(0)), send, group=self._group, async_op=True)
            self._account((M - 1) * (S + 1), (M - 1) * (S + 1))
        self._voted = (voted_pos, voted_nz)
        self._stage = 1

    def wait(self) -> torch.Tensor:
        """Finish the vote (issuing any remaining collectives) and return the voted tensor."""
        if self._stage == 2:
            return self._out
        self.exchange()
        if self._skipped:
            self._out.zero_()
            self._stage = 2
            self._recv = self._work = self._positive = self._nonzero = None
            return self._out
        voted_pos, voted_nz = self._voted
        if self._world_size > 1 and self._algorithm == "two_phase":
            M, S = self._world_size, self._shard
            self._work.wait()
            voted_pos = self._recv[:, 1:]
            if any(f & _HAS_ZERO for f in self._recv[:, 0].tolist()):
                gathered = voted_nz.new_empty(M, S)
                dist.all_gather(list(gathered.unbind(0)), voted_nz, group=self._group)
                self._account((M - 1) * S, (M - 1) * S)
                voted_nz = gathered
            else:
                voted_nz = None
        elif not bool((~voted_nz).any()):
            voted_nz = None  # all nonzero: skip that plane, half the unpack cost
        as_bytes = lambda w: w.contiguous().view(-1).view(torch.uint8)  # noqa: E731
        unpack_signs(
            as_bytes(voted_pos),
            self._numel,
            nonzero=None if voted_nz is None else as_bytes(voted_nz),
            out=self._out.view(-1),
        )
        self._stage = 2
        self._recv = self._work = self._voted = self._positive = self._nonzero = None  # free buffers
        return self._out

    @property
    def exchanged(self) -> bool:
        """Whether :meth:`exchange` has run (the second exchange, if any, is in flight)."""
        return self._stage >= 1

    def is_completed(self) -> bool:
        return self._stage == 2


def majority_vote_async(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    tie: Literal["exact", "fast"] = "exact",
    seed: int = 0,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    algorithm: Literal["auto", "two_phase", "all_gather"] = "auto",
    nonfinite: Literal["skip", "raise"] = "skip",
    label: str = "",
    fault: ByzantineFault | None = None,
) -> VoteWork:
    """Start a vote and return its :class:`VoteWork`; ``.wait()`` gives the voted tensor.

    Packing and the first exchange start before this returns, so they overlap with whatever
    the caller does next. Arguments are those of :func:`majority_vote`; ``label`` names the
    tensor in errors (e.g. ``"bucket 3"``).
    """
    return VoteWork(
        tensor, group, tie=tie, seed=seed, out=out, stats=stats, algorithm=algorithm, nonfinite=nonfinite, label=label,
        fault=fault,
    )  # fmt: skip


def majority_vote(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    tie: Literal["exact", "fast"] = "exact",
    seed: int = 0,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    algorithm: Literal["auto", "two_phase", "all_gather"] = "auto",
    nonfinite: Literal["skip", "raise"] = "skip",
    fault: ByzantineFault | None = None,
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
        nonfinite: if any rank's tensor holds NaN or Inf, ``"skip"`` returns zeros on every
            rank (counted in ``stats.skipped``) and ``"raise"`` raises :class:`NonFiniteError`
            on every rank; either way decided in the first exchange, with no extra round trip.
        fault: testing only: a :class:`~signmuon.comm_hooks.faults.ByzantineFault`.

    Returns:
        the voted tensor, entries in {-1, 0, +1}, in ``tensor``'s dtype (or ``out``).
    """
    return majority_vote_async(
        tensor, group, tie=tie, seed=seed, out=out, stats=stats, algorithm=algorithm, nonfinite=nonfinite, fault=fault
    ).wait()
