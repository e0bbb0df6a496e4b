"""The checks that make a round safe: every collective of the averager starts with one
all-gather of a fixed-size row (the same call, steps, shapes and settings on every rank, else
an error on every rank), which also carries the flags a round needs (NaN or Inf, a consensus
to compare) and a streamed landing's distance; and :class:`AgreedRounds`, the averager's use of
them (a mixin of :class:`~signmuon.optim.LocalStepAverager`)."""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats
from signmuon.comm_hooks.dist import (
    Agreement,
    NonFiniteError,
    check_same_settings,
    from_host,
    gather_rows,
    group_device,
    nonfinite_flag,
    settings_digest,
)

from ..params import local_tensor
from .settings import averager_settings

__all__ = ["AgreedRounds", "CALLS", "CallAgreement", "Carried", "outer_round_flags", "round_flags"]

CALLS = ("a local-step round", "consensus_state_dict")
"""The averager's collectives, as :class:`CallAgreement` names them."""


class Carried(NamedTuple):
    """What each rank's agreement row carries uncompared (:class:`CallAgreement`)."""

    unchecked: bool
    """This rank is new to the consensus (its first round, or loaded)."""
    nonfinite: bool
    """NaN or Inf in the parameters or buffers this rank's round takes (outer rounds)."""
    distance: float
    """This rank's distance to the consensus at a streamed round's landing (NaN: not a landing)."""


class CallAgreement:
    """Every rank enters the same collective of the averager (``call``, one of :data:`CALLS`)
    after the same number of optimizer steps, with the same parameter shapes, ``settings``
    digest and consensus, or :meth:`wait` raises on every rank. One all-gather of nine words,
    the same row for every call, issued here: a rank a step ahead (in a round while the others
    ask for the consensus, or asking for it at another step) meets the others in it and raises
    ``VoteMismatchError`` naming each rank's call and steps, instead of entering a collective
    the others do not (gloo aborts, NCCL hangs). ``restored_without_consensus``: this rank's
    step was restored but not its consensus (``ValueError`` on every rank where all agree on it).

    Three words ride in the row uncompared (``unchecked``, ``nonfinite``, a 0-d bool tensor on
    the device, and ``distance``): a round with an outer step needs no other all-gather before
    its combine. Waited for at once before a collective it guards; a streamed landing's, which
    none follows, at the averager's next collective, so that the landing waits for no rank."""

    def __init__(
        self,
        call: str,
        steps: int,
        params: list[torch.Tensor],
        group: dist.ProcessGroup,
        stats: CommStats | None,
        *,
        settings: int,
        restored_without_consensus: bool = False,
        unchecked: bool = False,
        nonfinite: torch.Tensor | None = None,
        distance: float | None = None,
    ) -> None:
        fields = {
            "call": CALLS.index(call),
            "steps": steps,
            "parameters": len(params),
            "shapes": settings_digest({"shapes": [(str(p.dtype), tuple(p.shape)) for p in params]}),
            "settings": settings,
            "consensus": int(restored_without_consensus),
        }
        device = group_device(group)
        bits = struct.unpack("<q", struct.pack("<d", math.nan if distance is None else distance))[0]
        flag = torch.zeros((), dtype=torch.bool, device=device) if nonfinite is None else nonfinite.to(device)
        self._steps, self._restored = steps, restored_without_consensus
        self._agreement = Agreement(
            fields,
            group,
            what="a local-step round or consensus_state_dict (every rank enters them after as many optimizer steps)",
            describe={"call": CALLS.__getitem__, "consensus": lambda word: "not restored" if word else "its own"},
            stats=stats,
            carried=torch.cat([from_host([int(unchecked), bits], torch.int64, device), flag.view(1).to(torch.int64)]),
        )

    def wait(self) -> list[Carried]:
        """Every rank's :class:`Carried` words, or the refusal on every rank."""
        words = self._agreement.wait()
        if self._restored:
            raise ValueError(
                f"the averager's step ({self._steps}) was restored without its consensus and outer optimizer "
                "(PostLocalSGDOptimizer.load_state_dict alone): load LocalStepAverager.state_dict() too, or resume "
                "through local_sgd's optimizer, whose state_dict holds it"
            )
        return [Carried(bool(u), bool(n), struct.unpack("<d", struct.pack("<q", d))[0]) for u, d, n in words]


@torch.no_grad()
def round_flags(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    group: dist.ProcessGroup,
    steps: int,
    stats: CommStats,
    *,
    settings: int = 0,
) -> tuple[list[torch.Tensor], list[int]]:
    """(the parameters with a gradient on any rank, the ranks holding NaN/Inf in those or in
    ``buffers``) of a round without an outer step: one all-gather, after :class:`CallAgreement`
    has checked that every rank is in a round after ``steps`` optimizer steps with the same
    parameter shapes and ``settings`` digest (else ``VoteMismatchError`` on every rank, rather
    than a collective of mismatched sizes). Parameters with a gradient on any rank take part
    everywhere, so one unused on a single rank is still averaged consistently."""
    device = group_device(group)
    CallAgreement(CALLS[0], steps, params, group, stats, settings=settings).wait()
    # [P + 1, 2] uint8: (has a gradient, holds NaN/Inf) per parameter, then (unused, the buffers' NaN/Inf).
    flags = torch.zeros(len(params) + 1, 2, dtype=torch.uint8, device=device)
    if params:
        flags[:-1, 0] = torch.tensor([p.grad is not None for p in params], device=device)
        flags[:-1, 1] = torch.stack([nonfinite_flag(local_tensor(p).detach()).to(device) for p in params])
    if buffers:
        flags[-1, 1] = torch.stack([nonfinite_flag(b).to(device) for b in buffers]).any()
    gathered = gather_rows(flags, group, stats).bool()  # [M, P + 1, 2]
    used = gathered[:, :-1, 0].any(dim=0)  # [P]
    bad = (gathered[:, :-1, 1] & used).any(dim=1) | gathered[:, -1, 1]  # [M]
    return [p for p, u in zip(params, used.tolist()) if u], bad.nonzero().view(-1).tolist()


@torch.no_grad()
def outer_round_flags(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    group: dist.ProcessGroup,
    steps: int,
    stats: CommStats,
    *,
    settings: int,
    unchecked: bool,
    restored_without_consensus: bool,
) -> list[Carried]:
    """Every rank's :class:`Carried` words at a round with an outer step, checked as
    :class:`CallAgreement` checks, in its one all-gather: every trained parameter takes part in
    the pseudo-gradient, so no rank's gradients need gathering, and NaN or Inf in any of
    ``params`` or ``buffers`` counts."""
    device = group_device(group)
    tensors = [local_tensor(p).detach() for p in params] + list(buffers)
    nonfinite = torch.stack([nonfinite_flag(t).to(device) for t in tensors]).any() if tensors else None
    return CallAgreement(
        CALLS[0],
        steps,
        params,
        group,
        stats,
        settings=settings,
        restored_without_consensus=restored_without_consensus,
        unchecked=unchecked,
        nonfinite=nonfinite,
    ).wait()


class AgreedRounds:
    """The checks :class:`~signmuon.optim.LocalStepAverager` makes before its collectives."""

    _landing_check: CallAgreement | None = None  # a streamed landing's agreement, read at the next collective

    def _check_settings(self) -> None:
        """At a fresh averager's first collective: the same settings on every rank."""
        if not self._settings_checked:
            check_same_settings(averager_settings(self), self.process_group, what="LocalStepAverager settings")
            self._settings_checked = True

    def _agreed_params(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The parameters every rank averages this round, or None when the round is skipped."""
        if dist._rank_not_in_group(self.process_group):
            return None
        self._check_landing()
        steps = self.step + 1  # the steps taken, this one included
        settings = settings_digest(averager_settings(self))
        if self.outer is None:
            used, bad_ranks = round_flags(
                params, self._buffers(), self.process_group, steps, self.stats, settings=settings
            )
        else:
            used = params
            carried = outer_round_flags(
                params,
                self._buffers(),
                self.process_group,
                steps,
                self.stats,
                settings=settings,
                unchecked=not self._consensus_checked,
                restored_without_consensus=self._restored_without_consensus,
            )
            bad_ranks = [rank for rank, words in enumerate(carried) if words.nonfinite]
            if any(words.unchecked for words in carried):  # some rank is new to this consensus: all compare
                for part in self.fragments:
                    part.consensus.check_same_start(self.stats)
                self._consensus_checked = True
        if bad_ranks:
            self.stats.skipped += 1
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"NaN or Inf in the parameters of rank(s) {bad_ranks} at a round (step {self.step})"
                )
            return None
        return used

    def _agree_on_call(self, call: str, steps: int, params: list[torch.Tensor], stats: CommStats | None) -> None:
        """:class:`CallAgreement` for this averager, after the last streamed landing's check."""
        self._check_landing()
        settings = settings_digest(averager_settings(self))
        CallAgreement(
            call,
            steps,
            params,
            self.process_group,
            stats,
            settings=settings,
            restored_without_consensus=self._restored_without_consensus,
        ).wait()

    def _check_landing(self) -> None:
        """Read the last streamed landing's check: a rank out of step with the others raises
        here, at its next collective of the averager; the workers' distances come with it."""
        if self._landing_check is not None:
            check, self._landing_check = self._landing_check, None
            carried = check.wait()
            if self.track_distances:
                distances = [words.distance for words in carried]
                self.mean_distance, self.max_distance = sum(distances) / len(distances), max(distances)
