"""The 1-bit majority-vote collective: every rank ends with ``sign(sum_i sign(v_i))``.

The schedule (all-to-all of packed shards, a vote per shard, all-gather of the voted shards;
or one all-gather for two ranks) is :mod:`~signmuon.comm_hooks.exchange`'s; what a shard holds
(the ``positive`` plane, zero lists or planes when there are zeros, tie-break coins) is
:mod:`~signmuon.comm_hooks.encoding`'s. Bytes one rank sends in the dense case (M ranks,
n entries, W = ceil(n/64) words, S = ceil(W/M)):

* two-phase: ``(M-1) * (2S + 6 + 3) * 8``, at most ``2(M-1)/M * n/8`` plus headers;
* all-gather: ``(M-1) * (W + 4 + 3) * 8``;
* the ``+ 3`` is the agreement round on entry count, dtype and tag, which the DDP hooks skip
  per bucket (DDP gives every rank the same buckets);
* k exact zeros add at most ``4k`` bytes per direction while they are few (a zero list),
  never more than one more bit plane.

``tie="fast"`` (the default) keeps the voted result at one bit per entry: ties between an equal
number of +1 and -1 voters are broken by a seeded unbiased coin keyed to (seed, step, parameter,
position). ``tie="exact"`` votes them 0, which then travel back as zeros (about 1.5 bits per entry
for an even world size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import ALGORITHMS, NONFINITE_ACTIONS, TIE_MODES, VoteConfig
from .encoding import SignEncoding, call_key
from .exchange import (
    CommStats,
    ExchangeWork,
    NonFiniteError,
    VoteMismatchError,
    default_two_phase,
    exchange_bytes_per_rank,
    group_size_rank,
)
from .kernels import kernels_for
from .kernels.layout import SignSegments, words_for
from .packing import check_float

__all__ = [
    "ALGORITHMS",
    "CommStats",
    "NONFINITE_ACTIONS",
    "NonFiniteError",
    "TIE_MODES",
    "VoteMismatchError",
    "VoteWork",
    "majority_vote",
    "majority_vote_async",
    "vote_bytes_per_rank",
]

_DEFAULT = VoteConfig()


def vote_bytes_per_rank(numel: int, world_size: int, algorithm: str = "auto", agree_sizes: bool = True) -> int:
    """Bytes one rank sends per dense-case call (no zeros, no exact-mode ties): the formula
    (``agree_sizes`` as in :func:`majority_vote`; the DDP hooks vote without it)."""
    two_phase = default_two_phase(algorithm, world_size)
    words = words_for(numel)
    shard = -(-words // world_size) if two_phase else words
    return exchange_bytes_per_rank(shard, world_size, two_phase, agree_sizes)


class VoteWork(ExchangeWork):
    """One majority vote in flight: :class:`ExchangeWork` with the :class:`SignEncoding`.

    ``VoteWork(...)`` packs and starts the first exchange; :meth:`exchange` waits for it, votes
    the local shard and starts the second; :meth:`wait` finishes and returns the voted tensor.
    Every collective is issued by the thread that calls these methods, in call order: gloo
    pairs collectives by issue order, so a collective issued from a future's callback thread
    could pair with a different one on another rank. A DDP hook interleaves the stages of
    consecutive buckets to overlap them with backward.
    """

    __slots__ = ()

    def __init__(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        config: VoteConfig | None = None,
        *,
        step: int = 0,
        segments: SignSegments | None = None,
        out: torch.Tensor | None = None,
        stats: CommStats | None = None,
        label: str = "",
        tag: int = 0,
        input_nonfinite: torch.Tensor | None = None,
        agree_sizes: bool = True,
        first_entry: int | None = None,
    ) -> None:
        config = _DEFAULT if config is None else config
        if not isinstance(config, VoteConfig):
            raise TypeError(f"config must be a VoteConfig, got {type(config).__name__}")
        flat = check_float(tensor)
        if out is None:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        elif out.shape != tensor.shape or not out.is_contiguous() or not out.is_floating_point():
            raise ValueError(f"out must be a contiguous float tensor shaped {tuple(tensor.shape)}")
        # first_entry: the tensor is entries first_entry.. of the one segments describe (a slice).
        if segments is not None and first_entry is None and segments.numel != flat.numel():
            raise ValueError(f"segments cover {segments.numel} entries, the tensor has {flat.numel()}")
        if segments is not None and first_entry is not None and segments.numel < first_entry + flat.numel():
            raise ValueError(f"segments cover {segments.numel} entries, the slice ends at {first_entry + flat.numel()}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (it keys the tie-break coins)")
        world_size, _ = group_size_rank(group)
        encoding = SignEncoding(
            kernels_for(flat.device, config.kernels), config.tie, call_key(config.seed, step), segments, config.fault,
            first_entry or 0,
        )
        super().__init__(
            encoding, flat, group, out=out, two_phase=default_two_phase(config.algorithm, world_size), stats=stats,
            nonfinite=config.nonfinite, label=label, tag=tag, input_nonfinite=input_nonfinite, agree_sizes=agree_sizes,
        )  # fmt: skip


def majority_vote_async(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: VoteConfig | None = None,
    *,
    step: int = 0,
    segments: SignSegments | None = None,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    label: str = "",
    tag: int = 0,
    input_nonfinite: torch.Tensor | None = None,
    agree_sizes: bool = True,
) -> VoteWork:
    """Start a vote and return its :class:`VoteWork`; ``.wait()`` gives the voted tensor.

    Packing and the first exchange start before this returns, so they overlap with whatever
    the caller does next. Arguments are those of :func:`majority_vote`; ``input_nonfinite``
    (0-d bool) marks this rank's input as non-finite although ``tensor`` is finite;
    ``agree_sizes=False`` skips the round that checks every rank's entry count, dtype and tag
    before the data travels (pass it only where the sizes are equal by construction: a rank
    with a different word count would abort the process group).
    """
    return VoteWork(
        tensor, group, config, step=step, segments=segments, out=out, stats=stats, label=label, tag=tag,
        input_nonfinite=input_nonfinite, agree_sizes=agree_sizes,
    )  # fmt: skip


def majority_vote(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: VoteConfig | None = None,
    *,
    step: int = 0,
    segments: SignSegments | None = None,
    out: torch.Tensor | None = None,
    stats: CommStats | None = None,
    label: str = "",
    tag: int = 0,
    agree_sizes: bool = True,
) -> torch.Tensor:
    """``sign(sum_i sign(tensor_i))`` over the ranks of ``group`` (None = WORLD), on every rank.

    Args:
        tensor: float tensor (fp32, bf16, fp16, fp64) of any shape, same shape on every rank.
        group: process group; without an initialised default group the caller is alone (M=1).
        config: the vote's settings (:class:`VoteConfig`: tie mode, seed, algorithm, what to do
            on NaN/Inf, kernels); the default is ``VoteConfig()``.
        step: which call this is (equal on every rank, e.g. the iteration): with the config's
            seed it keys the tie-break coins, so vary it per call.
        segments: keyed pieces of the tensor for the tie coins (e.g. parameters of a bucket).
        out: contiguous float tensor shaped like ``tensor`` to write into (may be ``tensor``).
        stats: a :class:`CommStats` the bytes sent and received are added to.
        label: names the tensor in errors (e.g. ``"bucket 3"``).
        tag: an identity of the call every rank must agree on (e.g. iteration and bucket);
            ranks that disagree, or pass different entry counts or dtypes, raise
            :class:`VoteMismatchError` on every rank, naming each rank's values (a fixed-size
            round before the data, so even sizes of different word counts fail cleanly).
        agree_sizes: ``False`` skips that round where the sizes are equal by construction.

    Returns:
        the voted tensor, entries in {-1, 0, +1}, in ``tensor``'s dtype (or ``out``). If any
        rank's tensor holds NaN or Inf, all zeros on every rank (``nonfinite="skip"``, counted in
        ``stats.skipped``) or :class:`NonFiniteError` on every rank (``"raise"``).
    """
    return majority_vote_async(
        tensor, group, config, step=step, segments=segments, out=out, stats=stats, label=label, tag=tag,
        agree_sizes=agree_sizes,
    ).wait()  # fmt: skip
