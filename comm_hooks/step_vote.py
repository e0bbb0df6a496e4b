"""The communication of an optimizer that votes inside ``step()`` instead of in a DDP hook
(``vote_in_step=True``: data parallelism without DDP, e.g. an engine whose own all-reduce is
off). Flat or node-aware, as the :class:`VoteConfig` says; the math stays the caller's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .dist import (
    CommStats,
    VoteMismatchError,
    all_reduce,
    check_same_settings,
    flatten,
    from_host,
    gather_rows,
    group_device,
    group_size_rank,
    host_words,
    mean_all_reduce,
    nonfinite_flag,
    split_like,
)
from .kernels.bits import SignSegments
from .vote import NodeLayout, OwnedVoteWork, VoteConfig, mean_node_aware, node_layout, vote_in_place

__all__ = ["StepVoter"]


class StepVoter:
    """Votes and means for one optimizer's ``step()`` across ``group``.

    Args:
        group: the voting ranks (None = WORLD).
        config: the vote's settings; ``hierarchical`` makes every call node-aware.
        stats: where bytes are counted.
    """

    __slots__ = ("group", "config", "stats", "_layout", "_settings_checked")

    def __init__(self, group: dist.ProcessGroup | None, config: VoteConfig, stats: CommStats) -> None:
        self.group, self.config, self.stats = group, config, stats
        self._layout: NodeLayout | None = None
        self._settings_checked = False

    @property
    def world_size(self) -> int:
        return group_size_rank(self.group)[0]

    def check_settings(self, settings: dict, what: str) -> None:
        """Compare ``settings`` across ranks, once (raises ``SettingsMismatchError`` on every rank)."""
        if not self._settings_checked:
            check_same_settings(settings, self.group, what=what)
            self._settings_checked = True

    def settings_changed(self) -> None:
        """The caller's settings changed (a new param group): compare them again at the next step."""
        self._settings_checked = False

    def layout(self) -> NodeLayout | None:
        """The node layout (made at the first call, on every rank alike), or None for the flat vote."""
        if not self.config.hierarchical or self.world_size == 1:
            return None
        if self._layout is None:
            self._layout = node_layout(self.group, self.config.ranks_per_node)
        return None if self._layout.flat else self._layout

    def used_on_any_rank(self, params: list[torch.Tensor], step: int, who: str) -> list[torch.Tensor]:
        """``params`` with a gradient on some rank (the same list on every rank), after checking
        that every rank is at the same ``step``: one all-gather of 1 + P words, read once."""
        row = from_host([step] + [p.grad is not None for p in params], torch.int64, group_device(self.group))
        width = 1 + len(params)
        words = host_words(gather_rows(row, self.group, self.stats).reshape(-1))  # [M, 1 + P], the one read
        rows = [words[r * width : (r + 1) * width] for r in range(len(words) // width)]
        steps = [r[0] for r in rows]
        if len(set(steps)) > 1:
            raise VoteMismatchError(
                f"{who}.step() entered at different steps ("
                + "; ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
                + "): resume every rank from the same checkpoint"
            )
        return [p for i, p in enumerate(params) if any(r[1 + i] for r in rows)]

    def agree_nonfinite(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether any rank's ``grads`` hold NaN or Inf (one all-reduce of one word, read once);
        where another rank's do and this rank's do not, one of this rank's is made NaN, so a
        check of the local gradients (a GradScaler's) finds it on every rank alike."""
        if self.world_size == 1:
            return bool(grads) and bool(torch.stack([nonfinite_flag(g) for g in grads]).any())
        device = group_device(self.group)
        mine = (
            torch.stack([nonfinite_flag(g).to(device) for g in grads]).any()
            if grads
            else torch.tensor(False, device=device)
        )
        flag = mine.to(torch.int64).reshape(1)
        self.stats.calls += 1
        all_reduce(flag, self.group, self.stats, op="max")
        anyone, here = host_words(torch.cat([flag, mine.to(torch.int64).reshape(1)]))
        if anyone and not here and grads:
            grads[0].fill_(float("nan"))
        return bool(anyone)

    def vote(
        self,
        grads: Sequence[torch.Tensor],
        direction: Callable[[int, torch.Tensor], torch.Tensor],
        owner: Callable[[int, int], int],
        *,
        present: Sequence[bool],
        step: int,
        label: str,
    ) -> list[torch.Tensor]:
        """The voted sign of each tensor's ``direction(i, grad)``, one vote for all of them.

        Flat: every rank computes the directions of the tensors it has a gradient for
        (``present``); elsewhere it abstains (votes 0, its momentum untouched). Node-aware: the
        gradients (zeros where absent) are averaged in the node and tensor i's direction is
        computed by its owner ``owner(i, L)`` alone (its momentum lives there), from the node mean.
        """
        if not grads:
            return []
        layout = self.layout()
        if layout is not None:
            voted = [g.clone() for g in grads]
            OwnedVoteWork(
                voted,
                direction,
                [owner(i, layout.ranks_per_node) for i in range(len(grads))],
                list(range(len(grads))),
                layout,
                self.config,
                step=step,
                stats=self.stats,
                label=label,
                tag=step,
            ).wait()  # all its stages at once
            return voted
        directions = [direction(i, g) if here else g for i, (g, here) in enumerate(zip(grads, present))]
        flat = flatten(directions)
        segments = SignSegments.of_pieces([d.numel() for d in directions], list(range(len(directions))))
        # The voted list is agreed by used_on_any_rank, its shapes by the settings.
        vote_in_place(flat, self.group, self.config.rail, step=step, segments=segments, stats=self.stats, label=label)
        return split_like(flat, directions)

    def mean(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The full-precision mean of each tensor over the ranks (node-aware where configured)."""
        if self.world_size == 1 or not grads:
            return list(grads)
        flat = flatten(grads)
        layout = self.layout()
        if layout is not None:
            mean_node_aware(flat, layout, self.stats)
        else:
            self.stats.calls += 1
            mean_all_reduce(flat, self.group, self.stats)
        return split_like(flat, grads)
