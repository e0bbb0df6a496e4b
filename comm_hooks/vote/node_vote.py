"""The node-aware vote: full precision inside a node, one bit per entry between nodes.

With N nodes of L ranks (``topology``), per tensor of n entries::

    1. all-reduce inside the node (full precision):  every local rank holds the node mean
    2. local rank l takes entries [l*c, (l+1)*c) of it, c = ceil(n/L) (:func:`node_slice`),
       and (optional) advances its momentum of those entries only: L local ranks keep one
       momentum between them
    3. local rank l votes its entries with the ranks of local index l on the other nodes
       (its *rail*): the vote's own transport, N voters
    4. all-gather inside the node of the voted slices (int8, one byte per entry)

The voters are the N nodes, each voting the sign of its mean gradient. Bytes that cross
between nodes, per node: L rails of ``vote_bytes_per_rank(c, N)`` each, about
``2(N-1)/N * n/8`` in all, spread over the node's L ranks (and NICs). Inside a node each rank
sends ``2(L-1)/L * n * 4`` (fp32 all-reduce) plus ``(L-1) * c`` bytes (the gather).

Tie coins are drawn for each entry's position in the whole tensor (``first_entry``), so they
are those of the same entries voted flat; a NaN or Inf anywhere in a node's mean flags that
node on every rail, so every rank skips (or raises on) the same tensors.

:class:`OwnedVoteWork` serves optimizers whose pre-vote step needs whole parameters (SignMuon's
Newton–Schulz): each parameter is *owned* by one local rank, which alone advances its
momentum and computes its direction, so that work is split L ways inside a node. Ownership is
decided once over all of an optimizer's parameters (not per DDP bucket, whose layout changes
after the first iteration and after a restart), so a parameter's momentum never changes hands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..dist import CommStats, all_reduce, flatten, gather_rows, mean_all_reduce, nonfinite_flag, ring_bytes, split_like
from ..kernels.bits import SignSegments
from .collective import VoteWork
from .config import VoteConfig
from .encodings import MomentumStep
from .topology import NodeLayout

__all__ = [
    "NodeVoteWork",
    "OwnedVoteWork",
    "gather_in_node",
    "merge_in_node",
    "mean_in_node",
    "node_slice",
    "mean_node_aware",
]


def node_slice(n: int, layout: NodeLayout) -> tuple[int, int]:
    """Entries [lo, hi) this local rank votes; c = ceil(n / L) each (the last ones may be short)."""
    c = -(-n // layout.ranks_per_node)
    lo = min(n, layout.local_rank * c)
    return lo, min(n, lo + c)


def mean_in_node(flat: torch.Tensor, layout: NodeLayout, stats: CommStats | None) -> torch.Tensor:
    """In place: ``flat`` becomes the mean over this rank's node (full precision)."""
    work = _start_mean_in_node(flat, layout, stats)
    if work is not None:
        work.wait()
    return flat


def _start_mean_in_node(flat: torch.Tensor, layout: NodeLayout, stats: CommStats | None):
    """Start :func:`mean_in_node`; its work handle (None where there is nothing to wait for)."""
    if layout.node_group is None or layout.ranks_per_node == 1:
        return None
    return mean_all_reduce(flat, layout.node_group, stats, inside_node=True, async_op=True)


def mean_node_aware(flat: torch.Tensor, layout: NodeLayout, stats: CommStats | None) -> torch.Tensor:
    """In place: the mean over every rank, in full precision, node-aware (node all-reduce, each
    local rank's slice all-reduced on its rail, slices gathered in the node)."""
    n, N = flat.numel(), layout.nodes
    mean_in_node(flat, layout, stats)
    lo, hi = node_slice(n, layout)
    piece = torch.zeros(-(-n // layout.ranks_per_node), dtype=flat.dtype, device=flat.device)
    piece[: hi - lo] = flat[lo:hi]
    if layout.rail_group is not None and N > 1:
        mean_all_reduce(piece, layout.rail_group, stats)
    gathered = gather_in_node(piece, layout, stats)
    flat.copy_(gathered.reshape(-1)[:n])
    return flat


def merge_in_node(values: torch.Tensor, held: torch.Tensor, layout: NodeLayout, stats: CommStats | None) -> None:
    """In place: ``values`` [n] takes, entry by entry, the value of the lowest local rank that
    ``held`` [n] (bool) it; entries no local rank holds become 0. Two all-reduces inside the
    node (the holder's index, then the values): for state whose pieces are spread over the
    node's ranks, once per change of layout, not per step."""
    if layout.node_group is None or layout.ranks_per_node == 1:
        values.masked_fill_(~held, 0)
        return
    holder = torch.where(held, layout.local_rank, layout.ranks_per_node).to(torch.int32)
    all_reduce(holder, layout.node_group, op="min")
    values.masked_fill_(holder != layout.local_rank, 0)
    all_reduce(values, layout.node_group)
    if stats is not None:  # the two rings counted as one message
        ring = ring_bytes(
            holder.numel() * holder.element_size() + values.numel() * values.element_size(), layout.ranks_per_node
        )
        stats.add(ring, ring, inside_node=True)


def gather_in_node(pieces: torch.Tensor, layout: NodeLayout, stats: CommStats | None) -> torch.Tensor:
    """[L, k]: every local rank's ``pieces`` ([k], the same k and dtype everywhere)."""
    if layout.node_group is None or layout.ranks_per_node == 1:
        return pieces.unsqueeze(0)
    return gather_rows(pieces, layout.node_group, stats, inside_node=True)


class _RailStages:
    """The stages the node-aware works share: the first :meth:`advance` waits for the node
    mean and starts the rail vote (the subclass's ``_start_rail``), the next advance it."""

    __slots__ = ("_rail",)

    def _start_rail(self) -> None:
        raise NotImplementedError

    @property
    def advanced(self) -> bool:
        return self._rail is not None and self._rail.advanced

    def advance(self) -> None:
        if self._rail is None:
            self._start_rail()
        else:
            self._rail.advance()

    @property
    def skipped(self) -> bool:
        """Whether the rail vote was skipped (NaN or Inf in some node's mean: alike on every rank)."""
        return self._rail is not None and self._rail.skipped

    def _rail_result(self) -> torch.Tensor:
        """Finish the rail vote (starting it first if no stage has): this rank's voted tensor."""
        if self._rail is None:
            self._start_rail()
        return self._rail.wait()


class NodeVoteWork(_RailStages):
    """One node-aware vote in flight, advanced in stages like :class:`VoteWork`.

    ``NodeVoteWork(...)`` starts averaging ``tensor`` inside the node (in place, asynchronously);
    each :meth:`advance` moves it one stage on: the first waits for the node mean and starts
    this rank's rail vote of its slice, the second advances that vote; :meth:`wait` finishes
    whatever is left and gathers the node's slices into ``out``. So in a DDP hook the node's
    all-reduce of one bucket runs while backward computes the next, as DDP's own does. With
    ``momentum`` (this rank's momentum of its slice, beta) the vote is Signum's: the slice
    advances with the node mean while it is packed (``MomentumStep``). NaN or Inf anywhere in the
    mean flags the node (the whole mean's flag, which every local rank shares, so every rail
    skips or raises on the same tensors, and no slice of the momentum takes it).
    """

    __slots__ = (
        "_layout",
        "_out",
        "_stats",
        "_slice",
        "_done",
        "_mean",
        "_averaging",
        "_config",
        "_momentum",
        "_vote_args",
    )

    def __init__(
        self,
        tensor: torch.Tensor,
        layout: NodeLayout,
        config: VoteConfig,
        *,
        out: torch.Tensor,
        step: int = 0,
        segments: SignSegments | None = None,
        stats: CommStats | None = None,
        label: str = "",
        tag: int = 0,
        momentum: tuple[torch.Tensor, float] | None = None,
    ) -> None:
        flat = tensor.view(-1)  # [n] a contiguous view: the mean is taken in place
        n = flat.numel()
        self._layout, self._out, self._stats, self._done = layout, out.view(-1), stats, False
        lo, hi = self._slice = node_slice(n, layout)
        if momentum is not None and momentum[0].numel() != hi - lo:
            raise ValueError(f"the momentum slice has {momentum[0].numel()} entries; this rank votes {hi - lo}")
        self._mean, self._rail = flat, None
        self._averaging = _start_mean_in_node(flat, layout, stats)
        self._config, self._momentum = config.rail, momentum
        self._vote_args = dict(
            step=step,
            segments=segments if segments is not None else SignSegments.whole(n),
            first_entry=lo,
            label=label,
            tag=tag,
        )

    def _start_rail(self) -> None:
        """Wait for the node mean; start this rank's rail vote of its slice."""
        if self._averaging is not None:
            self._averaging.wait()
        mean, (lo, hi) = self._mean, self._slice
        bad = nonfinite_flag(mean)
        voter, advance = mean[lo:hi], None
        if self._momentum is not None:
            buf, beta = self._momentum
            voter, advance = buf.view(-1), MomentumStep(mean[lo:hi], 1.0 - beta, bad)
        self._rail = VoteWork(
            voter,
            self._layout.rail_group,
            self._config,
            out=self._out[lo:hi],
            stats=self._stats,
            input_nonfinite=bad,
            agree_sizes=False,
            momentum=advance,
            **self._vote_args,
        )
        self._averaging = self._momentum = None

    def wait(self) -> torch.Tensor:
        if self._done:
            return self._out
        voted = self._rail_result()  # [hi - lo] this rank's slice, already in out
        n, (lo, hi) = self._out.numel(), self._slice
        c = -(-n // self._layout.ranks_per_node)
        piece = torch.zeros(c, dtype=torch.int8, device=voted.device)
        piece[: hi - lo] = voted
        gathered = gather_in_node(piece, self._layout, self._stats)  # [L, c]
        self._out.copy_(gathered.view(-1)[:n])
        self._done = True
        return self._out


class OwnedVoteWork(_RailStages):
    """A node-aware vote of per-tensor directions that need whole tensors, in flight, advanced
    in stages like :class:`NodeVoteWork`; results go into ``grads``.

    ``grads`` are this rank's gradients (overwritten with the voted signs when it finishes).
    ``OwnedVoteWork(...)`` starts averaging them inside the node (asynchronously, one
    all-reduce of them all); the first :meth:`advance` waits for the mean and lets each
    tensor's owner (``owner[i]``, the same on every rank and every call, e.g. :func:`~signmuon.optim.newton_schulz.assign_owners`
    over all of an optimizer's parameters) alone call ``directions(i, node_mean_i)``
    (advancing its momentum), then starts the vote of the owned directions, concatenated, on
    this rank's rail; the second advances it; :meth:`wait` finishes and gathers the voted
    tensors inside the node. A ``NonFiniteError`` is raised on every rank alike from the stage
    that reads the headers, after which :meth:`wait` gives zeros (skipped).
    """

    __slots__ = (
        "_grads",
        "_directions",
        "_owner",
        "_keys",
        "_layout",
        "_config",
        "_stats",
        "_vote_args",
        "_flat",
        "_averaging",
        "_done",
    )

    def __init__(
        self,
        grads: Sequence[torch.Tensor],
        directions: Callable[[int, torch.Tensor], torch.Tensor],
        owner: Sequence[int],
        keys: Sequence[int],
        layout: NodeLayout,
        config: VoteConfig,
        *,
        step: int,
        stats: CommStats | None,
        label: str,
        tag: int,
    ) -> None:
        if not grads:
            raise ValueError("OwnedVoteWork needs at least one tensor")
        self._grads, self._directions, self._owner, self._keys = list(grads), directions, list(owner), list(keys)
        self._layout, self._config, self._stats = layout, config, stats
        self._vote_args = dict(step=step, label=label, tag=tag)
        self._flat = flatten(self._grads)  # [n] all of them, for one node all-reduce
        self._averaging = _start_mean_in_node(self._flat, layout, stats)
        self._rail, self._done = None, False

    def _start_rail(self) -> None:
        if self._averaging is not None:
            self._averaging.wait()
        flat, grads, layout = self._flat, self._grads, self._layout
        bad = nonfinite_flag(flat)  # the node's, the same on each of its ranks
        means = split_like(flat, grads)
        mine = [i for i in range(len(grads)) if self._owner[i] == layout.local_rank]
        voter = flatten([self._directions(i, means[i]) for i in mine]) if mine else flat[:0]
        segments = (
            SignSegments.of_pieces([grads[i].numel() for i in mine], [self._keys[i] for i in mine]) if mine else None
        )
        self._rail = VoteWork(
            voter,
            layout.rail_group,
            self._config.rail,
            segments=segments,
            out=voter,
            stats=self._stats,
            input_nonfinite=bad,
            agree_sizes=False,
            **self._vote_args,
        )
        self._averaging = self._directions = None

    def wait(self) -> None:
        """Finish; ``grads`` then hold the voted signs (zeros where the vote was skipped)."""
        if self._done:
            return
        voted = self._rail_result()
        grads, layout = self._grads, self._layout
        # Every local rank's owned tensors, padded to the largest share, one byte per entry.
        shares = [sum(g.numel() for g, o in zip(grads, self._owner) if o == r) for r in range(layout.ranks_per_node)]
        piece = torch.zeros(max(shares), dtype=torch.int8, device=self._flat.device)
        piece[: voted.numel()] = voted
        gathered = gather_in_node(piece, layout, self._stats)  # [L, max share]
        offsets = [0] * layout.ranks_per_node
        for g, r in zip(grads, self._owner):
            g.copy_(gathered[r, offsets[r] : offsets[r] + g.numel()].view_as(g))
            offsets[r] += g.numel()
        self._done = True
        self._flat = self._rail = None
