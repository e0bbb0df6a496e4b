"""How a round combines the workers' pseudo-gradients: one :class:`Rule` per name of
:attr:`OuterStep.pseudo_gradient <signmuon.optim.rounds.OuterStep.pseudo_gradient>`, each
sending its encoding (fp32, the sign vote of ``OuterStep.vote``, 1-bit Adam's scaled signs)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, VoteConfig, VoteWork
from signmuon.comm_hooks.dist import gather_rows, group_size_rank, mean_all_reduce
from signmuon.comm_hooks.vote import scaled_sign_allreduce_start
from signmuon.comm_hooks.vote.encodings import decode_log_scales, encode_log_scales, error_buffer_sizes

__all__ = ["RULES", "Combining", "Rule", "combine_pseudo_gradients", "scale_blocks", "start_combining"]


@dataclasses.dataclass(frozen=True)
class Round:
    """What a rule gets besides the pseudo-gradient (see :func:`combine_pseudo_gradients`).
    Its sizes agree on every rank by construction (the rounds agree on the step and settings
    before any combine, and compare the consensus's shapes at the first round), so the
    encoded reductions skip their own round trip that agrees on them."""

    group: dist.ProcessGroup | None
    stats: CommStats | None
    segments: list[tuple[int, int, int]]
    errors: tuple[torch.Tensor, ...]
    vote: VoteConfig
    step: int
    scale_bits: int


class Combining:
    """A round's combine in flight: its collectives issued (asynchronous), :meth:`wait`
    finishes it. ``works`` are collectives' handles, ``transports`` encoded reductions
    (:class:`~signmuon.comm_hooks.vote.transport.TransportWork`); ``finish`` (called once they
    are waited for) returns the combined pseudo-gradient."""

    def __init__(self, finish: Callable[[], torch.Tensor], works=(), transports=()) -> None:
        self._finish, self._works, self._transports = finish, [w for w in works if w is not None], list(transports)

    def collectives(self) -> list[dist.Work]:
        """The collectives in flight now."""
        return self._works + [t.in_flight for t in self._transports if t.in_flight is not None]

    def issues_at_wait(self) -> bool:
        """Whether :meth:`wait` issues a collective of its own (a two-phase reduction's second)."""
        return any(t.two_phase and t.in_flight is not None for t in self._transports)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._finish()


def _mean(delta: torch.Tensor, r: Round) -> Combining:
    return Combining(lambda: delta, [mean_all_reduce(delta, r.group, r.stats, async_op=True)])


def _scaled_sign(delta: torch.Tensor, r: Round) -> Combining:
    work, finish = scaled_sign_allreduce_start(
        delta,
        *r.errors,
        r.group,
        kernels=r.vote.kernels,
        nonfinite=r.vote.nonfinite,
        stats=r.stats,
        label="a round's pseudo-gradient",
        agree_sizes=False,
    )
    return Combining(finish, transports=[work])


def _sign_vote(delta: torch.Tensor, r: Round, *, feedback: bool = False) -> Combining:
    """The vote of the signs, each block scaled by the workers' mean of its mean magnitude; with
    ``feedback`` each worker first adds, and then keeps, what its own scaled signs leave out."""
    if feedback:
        delta.add_(r.errors[0])
    blocks = [delta[a:b].view(-1, width) for a, b, width in r.segments]  # [blocks, width] each
    scales = torch.cat([rows.abs().mean(dim=1) for rows in blocks]) if blocks else delta.new_zeros(0)
    counts = [rows.shape[0] for rows in blocks]
    if feedback:
        for (a, b, width), rows, scale in zip(r.segments, blocks, scales.split(counts)):
            torch.sub(rows, rows.sign() * scale.unsqueeze(1), out=r.errors[0][a:b].view(-1, width))
    scales_work, mean_scales = _average_scales(scales, r.scale_bits, r.group, r.stats)
    vote = VoteWork(
        delta,
        r.group,
        r.vote,
        step=r.step,
        out=delta,
        stats=r.stats,
        label="a round's pseudo-gradient",
        agree_sizes=False,
    )

    def finish() -> torch.Tensor:
        vote.wait()
        for rows, scale in zip(blocks, mean_scales().split(counts)):
            rows.mul_(scale.unsqueeze(1))
        return delta

    return Combining(finish, [scales_work], [vote])


@dataclasses.dataclass(frozen=True)
class Rule:
    """One way to combine the pseudo-gradients."""

    start: Callable[[torch.Tensor, Round], Combining]
    """Starts combining this worker's flat pseudo-gradient (overwritten) with the others'."""
    error_sizes: Callable[[int, dist.ProcessGroup | None], tuple[int, ...]] | None = None
    """The sizes of its error-feedback buffers for ``numel`` entries combined over a group."""
    scaled: bool = False
    """Whether its signs carry scales (``OuterStep.scale_block`` and ``scale_bits``)."""


RULES = {
    "mean": Rule(_mean),
    "sign_vote": Rule(_sign_vote, scaled=True),
    "sign_vote_ef": Rule(functools.partial(_sign_vote, feedback=True), lambda numel, group: (numel,), scaled=True),
    "scaled_sign": Rule(_scaled_sign, lambda numel, group: error_buffer_sizes(numel, group_size_rank(group)[0])),
}
"""The rules by name; a new one is a function and an entry here (docs/design.md's recipe)."""


def combine_pseudo_gradients(*args, **options) -> torch.Tensor:
    """:func:`start_combining`'s combine, waited for."""
    return start_combining(*args, **options).wait()


def start_combining(
    delta: torch.Tensor,
    how: str,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
    *,
    segments: list[tuple[int, int, int]],
    errors: tuple[torch.Tensor, ...] = (),
    vote: VoteConfig | None = None,
    step: int = 0,
    scale_bits: int = 32,
) -> Combining:
    """Start combining the workers' pseudo-gradients ``delta`` (flat; overwritten) over ``group`` by the
    rule ``how``. ``segments`` are ``(start, stop, width)`` runs of ``delta`` cut into scale
    blocks of ``width`` entries (:func:`scale_blocks`), the blocks of a run scaled as the rows of
    one view; ``errors`` the rule's feedback buffers; ``step`` keys the tie coins; the scales
    travel in ``scale_bits`` (``OuterStep.scale_bits``)."""
    vote = vote if vote is not None else VoteConfig(tie="exact")
    return RULES[how].start(delta, Round(group, stats, segments, errors, vote, step, scale_bits))


def _average_scales(
    scales: torch.Tensor, bits: int, group: dist.ProcessGroup | None, stats: CommStats | None
) -> tuple[dist.Work | None, Callable[[], torch.Tensor]]:
    """Start the workers' mean of each float32 scale, sent in ``bits`` (``OuterStep.scale_bits``):
    the collective in flight, and the call that reads the mean once it is waited for."""
    if bits == 32:
        return mean_all_reduce(scales, group, stats, async_op=True), lambda: scales
    if bits == 16:
        sent = scales.to(torch.bfloat16)
        return mean_all_reduce(sent, group, stats, async_op=True), lambda: sent.to(scales.dtype)
    rows, work = gather_rows(encode_log_scales(scales), group, stats, async_op=True)
    return work, lambda: decode_log_scales(rows).mean(0)


@functools.lru_cache(maxsize=64)
def scale_blocks(sizes: tuple[int, ...], lo: int, hi: int, block: int = 0) -> list[tuple[int, int, int]]:
    """The scale blocks of the slice [lo, hi) of a flat group of tensors of ``sizes``, as
    ``(start, stop, width)`` runs relative to ``lo``: each run is whole blocks of ``width``
    entries, in order. ``block`` 0: one block per tensor; else each tensor's runs of ``block``
    entries counted from its start, so a tensor gives at most three runs (a block cut by ``lo``,
    its whole blocks, its last short block, or one cut by ``hi``), whatever its size."""
    found, start = [], 0
    for size in sizes:
        a, b = max(start, lo), min(start + size, hi)
        if b > a:
            width = block or size
            cut = start + -(-(a - start) // width) * width  # the first block boundary at or after a
            whole = start + (b - start) // width * width  # the last one at or before b
            if cut >= b:  # inside one block
                found.append((a - lo, b - lo, b - a))
            else:
                if cut > a:
                    found.append((a - lo, cut - lo, cut - a))
                if whole > cut:
                    found.append((cut - lo, whole - lo, width))
                if b > whole:
                    found.append((whole - lo, b - lo, b - whole))
        start += size
    return found
