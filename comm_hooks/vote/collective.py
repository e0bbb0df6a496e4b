"""The 1-bit majority-vote collective: every rank ends with ``sign(sum_i sign(v_i))``.

The schedule (all-to-all of packed shards, a vote per shard, all-gather of the voted shards;
or one all-gather for two ranks) is ``transport``'s; what a shard holds
(the ``positive`` plane, zero lists, runs or planes when there are zeros, tie-break coins) is
``encoding``'s. Bytes one rank sends in the dense case (M ranks,
n entries, W = ceil(n/64) words, S = ceil(W/M)):

* two-phase: ``(M-1) * (2S + 6 + 3) * 8``, at most ``2(M-1)/M * n/8`` plus headers;
* all-gather: ``(M-1) * (W + 4 + 3) * 8``;
* the ``+ 3`` is the agreement round on entry count, dtype and tag, which the DDP hooks skip
  per bucket (DDP gives every rank the same buckets);
* k exact zeros in r runs add at most ``8 min(ceil(k/2), r)`` bytes per direction while they
  are few (a zero list, or runs),
  never more than one more bit plane.

``tie="fast"`` (the default) keeps the voted result at one bit per entry: ties between an equal
number of +1 and -1 voters are broken by a seeded unbiased coin keyed to (seed, step, parameter,
position). ``tie="exact"`` votes them 0, which then travel back as zeros (about 1.5 bits per entry
for an even world size).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..dist import CommStats, group_size_rank
from ..kernels import kernels_for
from ..kernels.bits import SignSegments, words_for
from .config import VoteConfig
from .encodings import VOTE_ENCODINGS, MomentumStep, VoteCall
from .packing import check_float
from .transport import TransportWork, default_two_phase, transport_bytes_per_rank

__all__ = ["VoteWork", "majority_vote", "majority_vote_async", "vote_bytes_per_rank", "vote_in_place"]


def vote_bytes_per_rank(numel: int, world_size: int, algorithm: str = "auto", agree_sizes: bool = True) -> int:
    """Bytes one rank sends per dense-case call (no zeros, no exact-mode ties): the formula
    (``agree_sizes`` as in :func:`majority_vote`; the DDP hooks vote without it)."""
    two_phase = default_two_phase(algorithm, world_size)
    words = words_for(numel)
    shard = -(-words // world_size) if two_phase else words
    return transport_bytes_per_rank(shard, world_size, two_phase, agree_sizes)


class VoteWork(TransportWork):
    """One majority vote in flight: :class:`TransportWork` with the encoding ``config.encoding``
    names (``VOTE_ENCODINGS``; the sign encoding by default).

    ``VoteWork(...)`` packs and starts the first transport step; :meth:`advance` waits for it, votes
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
        momentum: MomentumStep | None = None,
    ) -> None:
        config = VoteConfig.of(config, "config")
        if config.hierarchical:
            raise ValueError(
                "majority_vote votes every rank's own signs; VoteConfig(hierarchical=True) votes node means and "
                "works where the node's momentum lives: SignVoteState / sign_vote_hook, SignMuon / SignumMV / "
                'SignSGDMV (DDP hook or vote_in_step) and a DeepSpeed config\'s "vote" section'
            )
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
        if momentum is not None and (momentum.grad.numel() != flat.numel() or momentum.grad.device != flat.device):
            raise ValueError(
                f"the momentum step's gradient ({momentum.grad.numel()} entries on {momentum.grad.device}) "
                f"must match the buffer voted ({flat.numel()} on {flat.device})"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (it keys the tie-break coins)")
        world_size, _ = group_size_rank(group)
        call = VoteCall(step, segments, first_entry or 0, momentum)
        encoding = VOTE_ENCODINGS[config.encoding](config, kernels_for(flat.device, config.kernels), call)
        super().__init__(
            encoding,
            flat,
            group,
            out=out,
            two_phase=default_two_phase(config.algorithm, world_size),
            stats=stats,
            nonfinite=config.nonfinite,
            label=label,
            tag=tag,
            input_nonfinite=input_nonfinite,
            agree_sizes=agree_sizes,
        )


def majority_vote_async(*args, **options) -> VoteWork:
    """The name ``VoteWork`` had until signmuon 0.1; it goes in 0.3."""
    warnings.warn(
        "majority_vote_async is now VoteWork (signmuon.comm_hooks.VoteWork), the same call; "
        "the old name is removed in signmuon 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return VoteWork(*args, **options)


def majority_vote(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: VoteConfig | None = None,
    **options,
) -> torch.Tensor:
    """``sign(sum_i sign(tensor_i))`` over the ranks of ``group`` (None = WORLD), on every rank.

    Args:
        tensor: float tensor (fp32, bf16, fp16, fp64) of any shape, same shape on every rank.
        group: process group; without an initialised default group the caller is alone (M=1).
        config: the vote's settings (:class:`VoteConfig`: tie mode, seed, algorithm, what to do
            on NaN/Inf, kernels); the default is ``VoteConfig()``.

    Keyword Args:
        step (int): which call this is (equal on every rank, e.g. the iteration): with the config's
            seed it keys the tie-break coins, so vary it per call.
        segments (SignSegments): keyed pieces of the tensor for the tie coins (e.g. parameters of a bucket).
        out (torch.Tensor): contiguous float tensor shaped like ``tensor`` to write into. ``tensor``
            itself votes in place, the cheapest call (no output to allocate: on CPU a fresh
            output's first touch costs about a third of the vote); a buffer kept across calls
            costs the same.
        stats (CommStats): a :class:`CommStats` the bytes sent and received are added to.
        label (str): names the tensor in errors (e.g. ``"bucket 3"``).
        tag (int): an identity of the call every rank must agree on (e.g. iteration and bucket);
            ranks that disagree, or pass different entry counts or dtypes, raise
            :class:`VoteMismatchError` on every rank, naming each rank's values (a fixed-size
            round before the data, so even sizes of different word counts fail cleanly).
        agree_sizes (bool): ``False`` skips that round where the sizes are equal by construction.

    Returns:
        the voted tensor, entries in {-1, 0, +1}, in ``tensor``'s dtype (or ``out``). If any
        rank's tensor holds NaN or Inf, all zeros on every rank (``nonfinite="skip"``, counted in
        ``stats.skipped``) or :class:`NonFiniteError` on every rank (``"raise"``).
    """
    return VoteWork(tensor, group, config, **options).wait()


def vote_in_place(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    config: VoteConfig,
    *,
    step: int,
    segments: SignSegments,
    stats: CommStats | None,
    label: str,
    input_nonfinite: torch.Tensor | None = None,
    tag: int | None = None,
) -> torch.Tensor:
    """:func:`majority_vote` of ``tensor`` into itself at ``step``, tagged ``tag`` (default:
    ``step``), for callers whose sizes agree by construction (an optimizer's step: its parameter
    shapes are compared with its settings)."""
    work = VoteWork(
        tensor,
        group,
        config,
        step=step,
        segments=segments,
        out=tensor,
        stats=stats,
        label=label,
        tag=step if tag is None else tag,
        input_nonfinite=input_nonfinite,
        agree_sizes=False,
    )
    return work.wait()
