"""What every DDP vote hook keeps: settings, consistency checks, parameter keys, the votes in
flight and statistics (:class:`VoteHookState`), picklable without its process group. The errors
it raises outside a hook call are :mod:`.hook_guards`'s."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from .ddp_group import ddp_model_of, group_ranks, resolve_group
from .dist import CommStats, NonFiniteError, agree, check_replicas, check_same_settings, group_size_rank
from .hook_guards import DeferredErrors, VotedGradients, watch_first_step
from .kernels.bits import SignSegments
from .pipeline import VotePipeline
from .vote import (
    MomentumStep,
    NodeLayout,
    NodeVoteWork,
    VoteConfig,
    VoteWork,
    node_layout,
)

__all__ = ["VoteHookState", "bucket_segments", "watch_first_step"]

logger = logging.getLogger(__name__)


_PROCESS_SLOTS = (
    "process_group",
    "gradients_may_lack",
    "pending",
    "settings_checked",
    "param_keys",
    "bucket_calls",
    "errors",
    "layout",
    "headers_agree",
    "voted_grads",
)
"""What a hook state does not pickle: this process's (``VoteHookState._start_process_state``)."""


class VoteHookState:
    """What every vote hook keeps: settings, the votes in flight, and statistics.

    Args:
        process_group: the group to vote over; ``None`` is the default (WORLD) group.
        vote: the vote's settings (:class:`VoteConfig`: tie mode, seed, algorithm, kernels, and
            ``nonfinite``: when any rank's bucket holds NaN or Inf, ``"skip"`` gives every rank a
            zero gradient for that bucket, counted in ``stats.skipped``, and ``"raise"`` raises
            ``NonFiniteError`` on every rank naming the ranks and the bucket; learnt in the
            vote's first transport step at no extra round trip; a rank whose own gradient is
            non-finite leaves its momentum untouched).
        check_replicas_every: every this many iterations (0 = never), each bucket's parameters
            are compared across ranks (a checksum all-gather) before voting; a divergence
            raises ``ReplicaDivergenceError`` naming the first differing tensor.

    Tie-break coins are keyed to (seed, iteration, parameter, position), so they do not depend
    on DDP's bucket layout. What every rank checks, and when (settings at the first call, the
    iteration and bucket of every vote, the first bucket of an iteration where no header has yet
    carried them), is in docs/reliability.md. ``NonFiniteError`` (``nonfinite="raise"``) leaves
    training usable: the hook hands DDP a zero gradient for the bucket and the error is raised
    from ``loss.backward()`` once DDP is done; catch it, zero the gradients, take the next batch.
    """

    __slots__ = ("vote_config", "check_replicas_every", "iter", "stats", "buckets_seen", *_PROCESS_SLOTS)

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        vote: VoteConfig | None = None,
        check_replicas_every: int = 0,
    ) -> None:
        vote = VoteConfig.of(vote)
        if (
            isinstance(check_replicas_every, bool)
            or not isinstance(check_replicas_every, int)
            or check_replicas_every < 0
        ):
            raise ValueError(f"check_replicas_every={check_replicas_every!r} must be a non-negative int (0 = never)")
        self.vote_config = vote
        self.check_replicas_every = check_replicas_every
        self.process_group = process_group
        self.iter = 0
        self.stats = CommStats()
        self.buckets_seen = 0  # hook calls ever (check_called_by_first_step reads it)
        self._start_process_state()

    def _start_process_state(self) -> None:
        """What belongs to this process, never saved: made new at construction and at unpickling."""
        self.settings_checked = False
        self.gradients_may_lack = True  # whether DDP may hand zeros for a missing gradient (learnt at the first call)
        self.param_keys: dict[torch.Tensor, int] = {}  # parameter -> stable key (first-seen order)
        self.bucket_calls = 0  # hook calls so far in this iteration
        self.errors = DeferredErrors()  # NonFiniteError raised once DDP's backward is done
        self.voted_grads = VotedGradients()  # refuses a backward into gradients still holding a vote
        self.layout: NodeLayout | None = None  # node and rail groups (hierarchical), made at the first call
        # Once a flat vote has run, every bucket's vote headers carry (iteration, bucket) and are
        # compared on every rank: the per-iteration agreement (a host read) is then redundant.
        self.headers_agree = False
        self.pending = VotePipeline(self.defer, self.hand_skipped)  # this backward pass's votes still in flight

    def settings(self) -> dict:
        """What must be equal on every rank (compared once, at the first hook call)."""
        return {
            "hook": type(self).__name__,
            **self.vote_config.settings(),
            "check_replicas_every": self.check_replicas_every,
        }

    @property
    def nonfinite(self) -> str:
        return self.vote_config.nonfinite

    def node_layout(self) -> NodeLayout | None:
        """The node layout of the node-aware vote, or None for the flat vote (also when there is
        one node or one rank per node). Made at the first call, on every rank alike."""
        if not self.vote_config.hierarchical:
            return None
        if self.layout is None:
            self.layout = node_layout(self.process_group, self.vote_config.ranks_per_node)
        return None if self.layout.flat else self.layout

    def begin_bucket(self, bucket: dist.GradBucket) -> None:
        """Consistency checks at the start of each hook call (collectives on this thread)."""
        flat = bucket.buffer()
        if not self.settings_checked:
            self.check_group_and_settings(bucket)
        if self.bucket_calls == 0:
            self.node_layout()
            if not self.headers_agree or self.check_replicas_every:  # the same decision on every rank
                agree(
                    {"iteration": self.iter, "bucket": bucket.index(), "entries": flat.numel()},
                    self.process_group,
                    what=f"{type(self).__name__}'s first bucket of an iteration",
                    stats=self.stats,
                )
            if self.nonfinite == "raise":
                self.errors.arm()
        self.bucket_calls += 1
        self.buckets_seen += 1
        if self.check_replicas_every and self.iter % self.check_replicas_every == 0:
            params = bucket.parameters()
            names = [f"bucket {bucket.index()} parameter {j} (shape {tuple(p.shape)})" for j, p in enumerate(params)]
            check_replicas(params, self.process_group, names=names)

    def check_group_and_settings(self, bucket: dist.GradBucket) -> None:
        """At the first call: vote over the DDP model's group (``ddp_group``), then compare the
        settings on every rank; a group other than DDP's is refused on every rank alike."""
        name = type(self).__name__
        ddp = ddp_model_of(bucket.parameters())
        self.process_group, refusal = resolve_group(
            self.process_group, None if ddp is None else ddp.process_group, name
        )
        # DDP hands zeros where a rank has no gradient; without find_unused_parameters only Join does.
        self.gradients_may_lack = ddp is None or ddp.find_unused_parameters
        voters = {"voters": group_ranks(self.process_group), "group is DDP's": refusal is None}
        check_same_settings({**self.settings(), **voters}, self.process_group, what=f"{name} settings")
        self.settings_checked = True
        if refusal is not None:
            raise ValueError(refusal)

    def check_called_by_first_step(self, optimizer: torch.optim.Optimizer, fix: str = "") -> None:
        """Raise ``RuntimeError`` at ``optimizer``'s first step if the hook has not run by then (a
        framework that drops a hook without a word); ``fix``, what to do there, ends the message.
        See :func:`watch_first_step`."""
        watch_first_step(self, optimizer, fix)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        # The last bucket is reduced last, so the count moves once per synchronised step.
        if bucket.is_last():
            self.iter += 1
            self.bucket_calls = 0

    def hand_skipped(self, bucket: torch.Tensor) -> torch.Tensor:
        """What DDP gets for a bucket whose vote was skipped (NaN or Inf on some rank): ``bucket``,
        zeroed by the vote (a hook state whose optimizer trains under a GradScaler makes it NaN)."""
        return bucket

    def defer(self, error: NonFiniteError, flag: torch.Tensor | None = None) -> None:
        """Raise ``error`` once DDP's backward is done (:meth:`DeferredErrors.defer`)."""
        self.errors.defer(error, flag)

    @property
    def raised(self) -> int:
        """Iterations whose backward raised ``NonFiniteError``."""
        return self.errors.raised

    def param_key(self, param: torch.Tensor) -> int:
        """A parameter's stable key: its order of first appearance to this state.

        DDP's first bucket layout is the same in every process of a model, so keys survive a
        restart even though DDP re-buckets after the first iteration.
        """
        return self.param_keys.setdefault(param, len(self.param_keys))

    def segments(self, bucket: dist.GradBucket, voted: list[bool] | None = None) -> SignSegments:
        """The bucket's (voted) parameters as keyed pieces of the voted flat tensor."""
        return bucket_segments(bucket, self.param_key, voted)

    def vote(
        self,
        bucket: dist.GradBucket,
        voter: torch.Tensor,
        out: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        voted: list[bool] | None = None,
        input_nonfinite: torch.Tensor | None = None,
        momentum: MomentumStep | None = None,
        node_momentum: tuple[torch.Tensor, float] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """Start voting ``voter`` into ``out`` for ``bucket``; the future DDP gets back.

        ``finish`` maps the voted tensor to the bucket's final tensor (default: the vote);
        ``voted`` marks which of the bucket's parameters ``voter`` holds (default: all);
        ``input_nonfinite`` (0-d bool) flags a non-finite gradient behind a finite ``voter``.
        Flat: ``momentum`` (a :class:`MomentumStep`) makes ``voter`` a momentum buffer advanced
        while it is packed. Node-aware (``VoteConfig(hierarchical=True)``): ``voter`` is the
        gradient, averaged in the node first; ``node_momentum`` (this rank's momentum of the
        slice it votes, beta) advances with that node mean while it is packed.
        """
        self.pending.advance()
        layout = self.node_layout()
        label, tag = f"bucket {bucket.index()} (iteration {self.iter})", (self.iter << 20) | bucket.index()
        common = dict(out=out, step=self.iter, segments=self.segments(bucket, voted), stats=self.stats)
        work: VoteWork | NodeVoteWork
        if layout is not None:
            work = NodeVoteWork(voter, layout, self.vote_config, label=label, tag=tag, momentum=node_momentum, **common)
        else:
            self.headers_agree = True
            work = VoteWork(
                voter,
                self.process_group,
                self.vote_config.rail,  # flat: one node, or one rank per node
                label=label,
                tag=tag,
                input_nonfinite=input_nonfinite,
                momentum=momentum,
                agree_sizes=False,  # DDP gives every rank the same buckets; the headers still check
                **common,
            )
        return self.track(bucket, work, finish)

    def track(
        self, bucket: dist.GradBucket, work, finish: Callable | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's future for ``work``, a vote this hook call started (after ``pending.advance()``),
        kept in the pipeline until a later call (or the last bucket's) finishes it; ``finish``
        maps its result to the bucket's final tensor."""
        grad = bucket.buffer()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[grad.device] if grad.is_cuda else None)
        self.pending.add(work, fut, finish)
        if bucket.is_last():
            self.pending.advance(drain=True)  # DDP calls no further hook in this backward
        self.maybe_increase_iter(bucket)
        return fut

    _UNPICKLED = _PROCESS_SLOTS

    @classmethod
    def _all_slots(cls) -> list[str]:
        return [slot for klass in cls.__mro__ for slot in getattr(klass, "__slots__", ())]

    def __getstate__(self) -> dict:
        # A process group cannot be pickled; like PowerSGDState, drop it and use WORLD on load.
        logger.warning(
            f"{type(self).__name__}: the process group is not serializable and is left out of the saved state"
        )
        state = {slot: getattr(self, slot) for slot in self._all_slots() if slot not in self._UNPICKLED}
        return {**state, "raised": self.raised}

    def __setstate__(self, state: dict) -> None:
        self.process_group = None
        self._start_process_state()
        self.buckets_seen = 0
        logger.warning(f"{type(self).__name__}: restored with the default process group (WORLD)")
        self.errors.raised = state.pop("raised", 0)
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict:
        """Iteration count, world size, this rank and statistics (plain types and tensors: loads
        with ``torch.load(..., weights_only=True)``)."""
        world_size, rank = group_size_rank(self.process_group)
        return {"iter": self.iter, "world_size": world_size, "rank": rank, "stats": self.stats.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`; raises ValueError if it was saved on another world size."""
        world_size, _ = group_size_rank(self.process_group)
        saved = int(state_dict.get("world_size", world_size))
        if saved != world_size:
            raise ValueError(
                f"the hook state was saved by one of {saved} ranks, and {world_size} ranks are loading it: "
                "each rank's momentum is its own, so resume on the same number of ranks"
            )
        self.iter = int(state_dict["iter"])
        self.stats.load_state_dict(state_dict["stats"])
        self.headers_agree = False  # a resumed rank agrees on its iteration again first


def bucket_segments(
    bucket: dist.GradBucket, param_key: Callable[[torch.Tensor], int], voted: list[bool] | None = None
) -> SignSegments:
    """The bucket's parameters (those marked in ``voted``, concatenated in bucket order) as
    pieces of the voted flat tensor, keyed by ``param_key`` (so tie coins follow parameters,
    not bucket layouts)."""
    flat = bucket.buffer()
    pieces = []
    for j, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        if voted is None or voted[j]:
            pieces.append(((g.data_ptr() - flat.data_ptr()) // flat.element_size(), g.numel(), param_key(p)))
    if voted is not None:  # the voted parameters are concatenated in bucket order
        offset, packed = 0, []
        for _, numel, key in sorted(pieces):
            packed.append((offset, numel, key))
            offset += numel
        pieces, total = packed, offset
    else:
        pieces, total = sorted(pieces), flat.numel()
    if not pieces:
        return SignSegments.whole(total)
    starts = [0] + [offset for offset, _, _ in pieces[1:]] + [total]
    return SignSegments(tuple(starts), tuple(key for _, _, key in pieces))
