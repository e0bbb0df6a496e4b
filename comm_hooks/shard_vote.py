"""The vote of a sharded model: FSDP2 inside each node, one bit per entry between nodes.

With the model sharded by ``fully_shard`` over the L ranks of a node, FSDP2's reduce-scatter
leaves local rank l holding rows ``[l*c, (l+1)*c)`` (c = ceil(rows / L), torch.chunk's split)
of each parameter's node-mean gradient. The vote between nodes then needs no more traffic
inside the node for tensors whose pre-vote math is elementwise (Signum, signSGD), and one
gather for those that need the whole tensor (SignMuon's Newton–Schulz). Per step:

1. per tensor, a node-wide flag: NaN or Inf in some rank's shard of its mean;
2. ``direction(i, shard)``: the elementwise half on this rank's shard (the momentum lives there);
3. tensors that need the whole: each rank sends its direction shard of a tensor to the tensor's
   owner (a local rank, the same on every node) alone, in one all-to-all inside the node, and
   the owner computes ``whole(i, tensor)``: a rank receives the float32 shards of the matrices
   it owns, about 1/L of them, never a copy of every matrix;
4. one vote per rank on its rail (the ranks of its local index, one per node): its shards of
   the elementwise tensors and the whole tensors it owns, with the coins those entries draw
   voted unsharded;
5. owned results, after ``finish(i, voted)`` (the post-vote polar step), go back in one
   all-to-all inside the node, each rank receiving only its rows.

A spec's ``ranges`` replace the row shards with any element ranges of the flattened tensor that
tile it in rank order (DeepSpeed ZeRO's flat partitions, which cut a tensor anywhere, mid-row
too): every step above is the same, on each rank's range.

The voters are the nodes, as in the node-aware DDP vote (``VoteConfig(hierarchical=True)``),
which computes the same thing from unsharded node means.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .dist import (
    CommStats,
    VoteMismatchError,
    agree,
    all_reduce,
    all_to_all,
    from_host,
    group_device,
    host_words,
    mean_all_reduce,
    nonfinite_flag,
)
from .kernels.bits import SignSegments
from .vote import NodeLayout, VoteConfig, vote_in_place

__all__ = ["ShardSpec", "ShardVoter"]


@dataclass(frozen=True)
class ShardSpec:
    """One tensor of the vote, sharded over the ranks of a node: by rows (FSDP2), or by ``ranges``."""

    shape: tuple[int, ...]
    """The whole tensor's shape (dimension 0 is the one FSDP2 shards)."""
    key: int
    """The tensor's stable number: it keys the tie coins."""
    owner: int | None = None
    """The local rank that assembles the whole tensor for ``whole``; None: elementwise."""
    ranges: tuple[tuple[int, int], ...] | None = None
    """Each local rank's element range [lo, hi) of the flattened tensor, in rank order, tiling it
    (a ZeRO partition's piece; empty where the partition holds none); None: row shards."""

    def __post_init__(self) -> None:
        if self.ranges is None:
            return
        ends = [0] + [hi for _, hi in self.ranges]
        if [lo for lo, _ in self.ranges] != ends[:-1] or ends[-1] != math.prod(self.shape) or ends != sorted(ends):
            raise ValueError(f"ranges {self.ranges} do not tile the {math.prod(self.shape)} entries in rank order")

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    def rows_per_rank(self, ranks_per_node: int) -> int:
        return -(-self.shape[0] // ranks_per_node) if self.shape else 1

    def rows(self, ranks_per_node: int, local_rank: int) -> tuple[int, int]:
        """Rows [lo, hi) of ``local_rank``'s shard (torch.chunk's split; the last may be short or empty)."""
        rows = self.shape[0] if self.shape else 1
        c = self.rows_per_rank(ranks_per_node)
        lo = min(rows, local_rank * c)
        return lo, min(rows, lo + c)

    def span(self, ranks_per_node: int, local_rank: int) -> tuple[int, int]:
        """Entries [lo, hi) of the flattened tensor that ``local_rank`` holds."""
        if self.ranges is not None:
            return self.ranges[local_rank]
        lo, hi = self.rows(ranks_per_node, local_rank)
        return lo * self.row_numel, hi * self.row_numel

    def capacity(self, ranks_per_node: int) -> int:
        """The most entries one rank holds: each rank's slot in the all-to-alls, padded to it."""
        if self.ranges is not None:
            return max(hi - lo for lo, hi in self.ranges)
        return self.rows_per_rank(ranks_per_node) * self.row_numel

    def piece_shape(self, ranks_per_node: int, local_rank: int) -> tuple[int, ...]:
        """The shape of ``local_rank``'s piece: its rows, or a flat range."""
        if self.ranges is not None:
            lo, hi = self.ranges[local_rank]
            return (hi - lo,)
        lo, hi = self.rows(ranks_per_node, local_rank)
        return (hi - lo, *self.shape[1:]) if self.shape else ()


class ShardVoter:
    """The communication of one optimizer step over row shards (see the module docstring).

    Args:
        layout: the node group (the ranks a tensor is sharded over) and the rail group.
        config: the vote's settings (``hierarchical`` is implied: the voters are nodes).
        stats: where bytes are counted (inside a node and between nodes).
        defer_mismatch: keep a rail's VoteMismatchError until :meth:`settle` (the vote goes on
            with zeros, that rail idle: its nodes may issue different units), so the node's other
            ranks, whose rails agree, learn of it too.
    """

    __slots__ = ("layout", "config", "stats", "defer_mismatch", "pending")

    def __init__(self, layout: NodeLayout, config: VoteConfig, stats: CommStats, defer_mismatch: bool = False) -> None:
        self.layout, self.config, self.stats = layout, config, stats
        self.defer_mismatch = defer_mismatch
        self.pending: VoteMismatchError | None = None

    def _mismatch(self, error: VoteMismatchError) -> None:
        if not self.defer_mismatch:
            raise error
        self.pending = self.pending or error

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Run a rail collective of the caller's (a whole vote step) under this voter's rule: a
        ``VoteMismatchError`` it raises waits for :meth:`settle` where mismatches are deferred."""
        try:
            yield
        except VoteMismatchError as error:
            self._mismatch(error)

    def settle(self, hint: str = "") -> None:
        """Raise a mismatch deferred on any rank of this node, on every rank (one tiny all-reduce
        in the node, read once; every rail reaches every node, so one hop tells every rank)."""
        flag = self.pending_flag()
        if self.layout.node_group is not None and self.layout.ranks_per_node > 1:
            all_reduce(flag, self.layout.node_group, op="max")
        self.raise_agreed(bool(host_words(flag)[0]), hint)

    def pending_flag(self) -> torch.Tensor:
        """1 where this rank holds a deferred mismatch, else 0: one int64 word on the device, made
        without a stall, for an agreement over the node or wider (settle's, or one the caller runs anyway)."""
        return from_host([int(self.pending is not None)], torch.int64, self.device)

    def raise_agreed(self, any_pending: bool, hint: str = "") -> None:
        """Given whether any rank of the agreement on :meth:`pending_flag` held a mismatch: raise
        it on every rank (where this rank held one, its own), and forget it."""
        error, self.pending = self.pending, None
        if error is not None:
            raise VoteMismatchError(f"{error}{hint}") from error
        if any_pending:
            raise VoteMismatchError(
                "another rank of this node met ranks of other nodes at a different vote (another step, or another "
                f"FSDP unit) and raised VoteMismatchError: every rank stops at the same place{hint}"
            )

    @property
    def device(self) -> torch.device:
        """Where this step's tensors live: the rail's device, also on a rank that holds no shard."""
        return group_device(self.layout.rail_group)

    def _node_flags(self, shards: Sequence[torch.Tensor | None]) -> tuple[list[bool], torch.Tensor]:
        """Per tensor: NaN or Inf in the shard of some rank of the node (one tiny all-reduce);
        and whether any tensor holds one, as a 0-d tensor on the device."""
        flags = torch.stack(
            [
                nonfinite_flag(s) if s is not None else torch.zeros((), dtype=torch.bool, device=self.device)
                for s in shards
            ]
        ).to(torch.int32)
        if self.layout.node_group is not None and self.layout.ranks_per_node > 1:
            all_reduce(flags, self.layout.node_group, op="max")
            size = 2 * flags.numel() * flags.element_size()  # as counted before: what a tiny all-reduce sends
            self.stats.add(size, size, inside_node=True)
        return [bool(f) for f in flags.tolist()], flags.any()  # the one read; and the node's flag, on the device

    def vote(
        self,
        shards: Sequence[torch.Tensor | None],
        specs: Sequence[ShardSpec],
        direction: Callable[[int, torch.Tensor], torch.Tensor],
        whole: Callable[[int, torch.Tensor], torch.Tensor],
        finish: Callable[[int, torch.Tensor], torch.Tensor] | None,
        *,
        step: int,
        label: str,
        tag: int | None = None,
    ) -> list[torch.Tensor]:
        """This rank's shard of each tensor's voted update.

        ``shards[i]`` is this rank's shard of tensor i's node-mean gradient (None: no gradient
        on this node, which then abstains on it). Results are shaped like this rank's shard of
        ``specs[i].shape``, with entries in {-1, 0, +1} (or ``finish``'s values on whole tensors).
        ``tag`` (default ``step``) identifies the call on the rail: ranks that disagree raise
        :class:`~signmuon.comm_hooks.VoteMismatchError` on every rank.
        """
        if not shards:
            return []
        L, local = self.layout.ranks_per_node, self.layout.local_rank
        device = self.device
        bad, any_bad = self._node_flags(shards)
        usable = [s is not None and not b for s, b in zip(shards, bad)]
        dirs = [direction(i, s) if ok else None for i, (s, ok) in enumerate(zip(shards, usable))]
        whole_idx = [i for i, spec in enumerate(specs) if spec.owner is not None]
        mine = [i for i in whole_idx if specs[i].owner == local]
        owned = {}
        if whole_idx:
            # Each whole tensor's direction shard, padded to the largest shard, to its owner alone.
            size = {i: specs[i].capacity(L) for i in whole_idx}
            by_owner = [[i for i in whole_idx if specs[i].owner == r] for r in range(L)]
            send = torch.zeros(sum(size.values()), dtype=torch.float32, device=device)
            offset = 0
            for i in (i for r in range(L) for i in by_owner[r]):
                if dirs[i] is not None:
                    send[offset : offset + dirs[i].numel()] = dirs[i].reshape(-1)
                offset += size[i]
            splits = [sum(size[i] for i in by_owner[r]) for r in range(L)]
            received = self._in_node(send, splits, [splits[local]] * L).view(L, splits[local])  # [source, mine]
            offset = 0
            for i in mine:
                if usable[i]:
                    spans = [specs[i].span(L, s) for s in range(L)]
                    entries = torch.cat([received[s, offset : offset + hi - lo] for s, (lo, hi) in enumerate(spans)])
                    owned[i] = whole(i, entries.view(specs[i].shape))
                offset += size[i]
        # This rank's rail vote: its shards of elementwise tensors, then the whole tensors it owns.
        pieces, keys, firsts = [], [], []
        for i, spec in enumerate(specs):
            if spec.owner is None:
                lo, hi = spec.span(L, local)
                pieces.append(dirs[i].reshape(-1) if dirs[i] is not None else torch.zeros(hi - lo, device=device))
                keys.append(spec.key)
                firsts.append(lo)
        for i in mine:
            n = math.prod(specs[i].shape)
            pieces.append(owned[i].reshape(-1) if i in owned else torch.zeros(n, device=device))
            keys.append(specs[i].key)
            firsts.append(0)
        voter = torch.cat([p.float() for p in pieces]) if pieces else torch.zeros(0, device=device)
        segments = SignSegments.of_pieces([p.numel() for p in pieces], keys, firsts) if pieces else None
        rail = self.layout.rail_group, self.config.rail
        try:
            if self.pending is not None:  # the rail's ranks all met the mismatch: none calls it again
                raise self.pending
            voted = vote_in_place(
                voter,
                *rail,
                step=step,
                segments=segments,
                stats=self.stats,
                label=label,
                input_nonfinite=any_bad,
                tag=tag,
            )
        except VoteMismatchError as error:  # every rank of the rail raises it, the node's others may not
            self._mismatch(error)
            voted = torch.zeros_like(voter)
        results: list[torch.Tensor | None] = [None] * len(specs)
        cursor = 0
        for i, spec in enumerate(specs):
            if spec.owner is None:
                lo, hi = spec.span(L, local)
                results[i] = voted[cursor : cursor + hi - lo].view(spec.piece_shape(L, local))
                cursor += hi - lo
        if whole_idx:
            self._scatter_owned(voted[cursor:], specs, whole_idx, finish, results, device)
        return results  # type: ignore[return-value]

    def _in_node(self, send: torch.Tensor, send_splits: list[int], receive_splits: list[int]) -> torch.Tensor:
        if self.layout.node_group is None or self.layout.ranks_per_node == 1:
            return send
        return all_to_all(send, send_splits, receive_splits, self.layout.node_group, self.stats, inside_node=True)

    def _scatter_owned(self, voted, specs, whole_idx, finish, results, device) -> None:
        """Every owner's voted whole tensors (after ``finish``) back to the ranks that hold their
        shards, each rank receiving its shard alone (padded to the largest): one all-to-all in the node."""
        L, local = self.layout.ranks_per_node, self.layout.local_rank
        size = {i: specs[i].capacity(L) for i in whole_idx}
        by_owner = [[i for i in whole_idx if specs[i].owner == r] for r in range(L)]
        dtype = torch.int8 if finish is None else torch.float32  # signs travel as one byte each
        mine = sum(size[i] for i in by_owner[local])
        send = torch.zeros(L * mine, dtype=dtype, device=device)  # [rank, my tensors' rows for it]
        cursor, offset = 0, 0
        for i in by_owner[local]:
            spec = specs[i]
            n = math.prod(spec.shape)
            done = voted[cursor : cursor + n].view(spec.shape)
            done = (finish(i, done) if finish is not None else done).reshape(-1)
            for s in range(L):
                lo, hi = spec.span(L, s)
                start = s * mine + offset
                send[start : start + hi - lo] = done[lo:hi]
            cursor += n
            offset += size[i]
        splits = [sum(size[i] for i in by_owner[r]) for r in range(L)]
        received = self._in_node(send, [mine] * L, splits)
        starts = [sum(splits[:r]) for r in range(L)]
        for r in range(L):
            offset = starts[r]
            for i in by_owner[r]:
                lo, hi = specs[i].span(L, local)
                results[i] = received[offset : offset + hi - lo].view(specs[i].piece_shape(L, local)).float()
                offset += size[i]

    def mean(
        self,
        shards: Sequence[torch.Tensor | None],
        shapes: Sequence[tuple[int, ...]],
        *,
        tag: int | None = None,
        label: str = "",
    ) -> list[torch.Tensor]:
        """The mean over every rank of each tensor's node-mean shard (None: zeros): one
        full-precision all-reduce on the rail. With ``tag``, a tiny round first checks that every
        rail rank passes the same (an all-reduce has no header of its own to compare):
        :class:`~signmuon.comm_hooks.VoteMismatchError` on every rank, naming each one's."""
        if not shards:
            return []
        device = self.device
        if tag is not None:
            try:
                agree({"tag": tag}, self.layout.rail_group, what=label or "the same mean", stats=self.stats)
            except VoteMismatchError as error:
                self._mismatch(error)
                return [torch.zeros(shape, device=device) for shape in shapes]
        full = [s.float() if s is not None else torch.zeros(shape, device=device) for s, shape in zip(shards, shapes)]
        flat = torch.cat([f.reshape(-1) for f in full])
        self.stats.calls += 1
        mean_all_reduce(flat, self.layout.rail_group, self.stats)
        out, cursor = [], 0
        for f in full:
            out.append(flat[cursor : cursor + f.numel()].view_as(f))
            cursor += f.numel()
        return out
