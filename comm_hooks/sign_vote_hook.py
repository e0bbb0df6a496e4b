"""DDP communication hook: signSGD / Signum with majority vote, one bit per gradient entry.

Example (signSGD-MV; ``momentum=0.9`` gives Signum-MV)::

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from signmuon.comm_hooks import SignVoteState, sign_vote_hook

    model = DDP(net)
    state = SignVoteState(process_group=None, momentum=0.0, start_iter=1)
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)   # applies lr * vote: signSGD-MV

The hook's output, which DDP writes into every ``param.grad``, is the voted tensor with
entries in {-1, 0, +1} (not an average), so plain SGD takes a step of exactly ``lr`` per
entry. For Signum, momentum is kept on each worker *before* the sign, per bucket.

Anything that rescales ``.grad`` between the hook and ``SGD.step()`` changes that step:
``clip_grad_norm_(max_norm)`` shrinks the ±1 vote (whose norm is about sqrt(n)) and with it
every step, and GradScaler's unscaling divides it by the loss scale. Leave clipping off with
the bare hook, or use ``signmuon.optim.SignumMV`` / ``SignSGDMV`` / ``SignMuon``, whose steps
take the sign of what the vote left in ``.grad`` and so ignore any positive rescaling.

Host synchronisations per bucket on a GPU: two. The first reads the headers of the vote's first
exchange (they decide the NaN/Inf skip and the sizes of the optional zero lists); the second
reads the voted result's zero count (the headers of the second exchange, or for two ranks the
local vote's); plus one per iteration, at its first bucket, for the agreement on the iteration
counter. Signum's finiteness check of the gradient stays on the device.

With ``VoteConfig(hierarchical=True)`` the hook votes node-aware (``comm_hooks.hierarchy``):
gradients are averaged inside each node in full precision and only the node means' signs are
voted between nodes; Signum's momentum then follows the node mean.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import collections
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collective import VoteWork, majority_vote_async
from .config import VoteConfig
from .consistency import check_replicas, check_same_settings
from .exchange import CommStats, NonFiniteError, agree, group_size_rank
from .hierarchy import NodeVoteWork
from .topology import NodeLayout, node_layout
from .kernels.layout import SignSegments
from .packing import nonfinite_flag

__all__ = ["VoteHookState", "SignVoteState", "sign_vote_hook", "allreduce_mean", "allreduce_hook", "advance_momentum"]

logger = logging.getLogger(__name__)


class VoteHookState:
    """What every vote hook keeps: settings, the votes in flight, and statistics.

    Args:
        process_group: the group to vote over; ``None`` is the default (WORLD) group.
        vote: the vote's settings (:class:`VoteConfig`: tie mode, seed, algorithm, kernels, and
            ``nonfinite``: when any rank's bucket holds NaN or Inf, ``"skip"`` gives every rank a
            zero gradient for that bucket, counted in ``stats.skipped``, and ``"raise"`` raises
            ``NonFiniteError`` on every rank naming the ranks and the bucket; learnt in the
            vote's first exchange at no extra round trip; a rank whose own gradient is
            non-finite leaves its momentum untouched).
        check_replicas_every: every this many iterations (0 = never), each bucket's parameters
            are compared across ranks (a checksum all-gather) before voting; a divergence
            raises ``ReplicaDivergenceError`` naming the first differing tensor.

    Tie-break coins are keyed to (seed, iteration, parameter, position), so they do not depend
    on DDP's bucket layout; each vote's header carries (iteration, bucket), so ranks whose
    states disagree raise ``VoteMismatchError`` instead of voting different buckets together.

    At its first call the hook compares all ranks' settings (one digest all-gather) and
    raises ``SettingsMismatchError`` on every rank if any differ. At the first bucket of every
    iteration it compares the iteration counters and that bucket's size (one all-gather of three
    words), so a rank resumed from a stale state raises ``VoteMismatchError`` on every rank
    before warm-up all-reduces, votes and replica checks could pair up wrongly.

    ``NonFiniteError`` (``nonfinite="raise"``) leaves training usable: the hook hands DDP a zero
    gradient for the bucket, so DDP finishes its backward pass normally, and the error is raised
    from ``loss.backward()`` once DDP is done, the same in warm-up and voting iterations. Catch
    it, zero the gradients and take the next batch.
    """

    __slots__ = (
        # settings
        "process_group",
        "vote_config",
        "check_replicas_every",
        # internal state
        "iter",
        "pending",
        "settings_checked",
        "param_keys",
        "bucket_calls",
        "deferred_error",
        "raise_queued",
        "layout",
        # statistics
        "stats",
        "raised",
        "buckets_seen",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        vote: VoteConfig | None = None,
        check_replicas_every: int = 0,
    ) -> None:
        vote = VoteConfig() if vote is None else vote
        if not isinstance(vote, VoteConfig):
            raise TypeError(f"vote must be a VoteConfig, got {type(vote).__name__}")
        if isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) or check_replicas_every < 0:
            raise ValueError(f"check_replicas_every={check_replicas_every!r} must be a non-negative int (0 = never)")
        self.vote_config = vote
        self.check_replicas_every = check_replicas_every
        self.settings_checked = False
        self.process_group = process_group
        self.param_keys: dict[torch.Tensor, int] = {}  # parameter -> stable key (first-seen order)
        self.iter = 0
        self.bucket_calls = 0  # hook calls so far in this iteration
        self.deferred_error: NonFiniteError | None = None  # raised once DDP's backward is done
        self.raise_queued = False  # whether a callback will raise it at the end of backward
        self.layout: NodeLayout | None = None  # node and rail groups (hierarchical), made at the first call
        # Votes of this backward pass still in flight, oldest first: (work, DDP's future, finish).
        self.pending: collections.deque[tuple[VoteWork, torch.futures.Future, Callable | None]] = collections.deque()
        self.stats = CommStats()
        self.raised = 0  # iterations whose backward raised NonFiniteError
        self.buckets_seen = 0  # hook calls ever (check_called_by_first_step reads it)

    def settings(self) -> dict:
        """What must be equal on every rank (compared once, at the first hook call)."""
        return {"hook": type(self).__name__, **self.vote_config.settings(), "check_replicas_every": self.check_replicas_every}

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
        device = flat.device
        if not self.settings_checked:
            check_same_settings(self.settings(), self.process_group, what=f"{type(self).__name__} settings", device=device)
            self.settings_checked = True
        if self.bucket_calls == 0:
            self.node_layout()
            agree(
                {"iteration": self.iter, "bucket": bucket.index(), "entries": flat.numel()},
                self.process_group,
                what=f"{type(self).__name__}'s first bucket of an iteration",
                device=device,
                stats=self.stats,
            )
            if self.nonfinite == "raise":
                self.raise_queued = _raise_after_backward(self)
        self.bucket_calls += 1
        self.buckets_seen += 1
        if self.check_replicas_every and self.iter % self.check_replicas_every == 0:
            params = bucket.parameters()
            names = [f"bucket {bucket.index()} parameter {j} (shape {tuple(p.shape)})" for j, p in enumerate(params)]
            check_replicas(params, self.process_group, names=names)

    def check_called_by_first_step(self, optimizer: torch.optim.Optimizer, fix: str = "") -> None:
        """Raise ``RuntimeError`` at ``optimizer``'s first step if the hook has not run by then.

        Frameworks can drop a registered hook without a word (one registers comm hooks on CUDA
        only, one ignores hooks it does not know): training then goes on with unreduced local
        gradients and the replicas drift apart. ``fix`` (what to do in the framework at hand)
        ends the message. Checked once; later steps are not watched. A step given a closure
        (Lightning's) runs backward inside ``step()``, so that step is checked when it returns.
        """
        seen = self.buckets_seen
        handles: list = []

        def check(opt: torch.optim.Optimizer) -> None:
            for handle in handles:
                handle.remove()
            if self.buckets_seen == seen:
                raise RuntimeError(
                    f"{type(opt).__name__}.step(): the {type(self).__name__} communication hook has not run since it "
                    "was registered, so the gradients were never voted and each rank would train alone. "
                    + (fix or "Register it on the DistributedDataParallel model that runs the backward pass.")
                )

        def before(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            if not args and kwargs.get("closure") is None:
                check(opt)

        handles.append(optimizer.register_step_pre_hook(before))
        handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: check(opt)))

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        # The last bucket is reduced last, so the count moves once per synchronised step.
        if bucket.is_last():
            self.iter += 1
            self.bucket_calls = 0

    def defer(self, error: NonFiniteError) -> None:
        """Keep ``error`` to raise after DDP's backward (raising inside DDP would break it)."""
        if not self.raise_queued:
            raise error  # not inside a backward pass: nothing to protect
        if self.deferred_error is None:
            self.deferred_error = error

    def param_key(self, param: torch.Tensor) -> int:
        """A parameter's stable key: its order of first appearance to this state.

        DDP's first bucket layout is the same in every process of a model, so keys survive a
        restart even though DDP re-buckets after the first iteration.
        """
        return self.param_keys.setdefault(param, len(self.param_keys))

    def segments(self, bucket: dist.GradBucket, voted: list[bool] | None = None) -> SignSegments:
        """The bucket's (voted) parameters as keyed pieces of the voted flat tensor."""
        flat = bucket.buffer()
        pieces = []
        for j, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
            if voted is None or voted[j]:
                pieces.append(((g.data_ptr() - flat.data_ptr()) // flat.element_size(), g.numel(), self.param_key(p)))
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

    def vote(
        self,
        bucket: dist.GradBucket,
        voter: torch.Tensor,
        out: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        voted: list[bool] | None = None,
        input_nonfinite: torch.Tensor | None = None,
        prepare: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """Start voting ``voter`` into ``out`` for ``bucket``; the future DDP gets back.

        ``finish`` maps the voted tensor to the bucket's final tensor (default: the vote);
        ``voted`` marks which of the bucket's parameters ``voter`` holds (default: all);
        ``input_nonfinite`` (0-d bool) flags a non-finite gradient behind a finite ``voter``.
        Node-aware (``VoteConfig(hierarchical=True)``): ``voter`` is the gradient, averaged in
        the node first, and ``prepare`` maps that node mean to (what to vote, non-finite flag).
        """
        self.advance_pending()
        layout = self.node_layout()
        label, tag = f"bucket {bucket.index()} (iteration {self.iter})", (self.iter << 20) | bucket.index()
        work: VoteWork | NodeVoteWork
        if layout is not None:
            work = NodeVoteWork(
                voter, layout, self.vote_config, out=out, step=self.iter, segments=self.segments(bucket, voted),
                stats=self.stats, label=label, tag=tag, prepare=prepare,
            )  # fmt: skip
        else:
            work = majority_vote_async(
                voter,
                self.process_group,
                self.vote_config,
                step=self.iter,
                segments=self.segments(bucket, voted),
                out=out,
                stats=self.stats,
                label=label,
                tag=tag,
                input_nonfinite=input_nonfinite,
                agree_sizes=False,  # DDP gives every rank the same buckets; the headers still check
            )
        grad = bucket.buffer()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[grad.device] if grad.is_cuda else None)
        self.pending.append((work, fut, finish))
        if bucket.is_last():
            self.advance_pending(drain=True)  # DDP calls no further hook in this backward
        self.maybe_increase_iter(bucket)
        return fut

    def advance_pending(self, drain: bool = False) -> None:
        """Move earlier buckets' votes one stage on (all of them to the end if ``drain``).

        Collectives are issued here, on the autograd thread, oldest bucket first, so every rank
        issues the same sequence; a vote's second exchange thus overlaps the next bucket's
        backward. On an error every pending future fails, so DDP never waits forever.
        """
        remaining: collections.deque = collections.deque()
        try:
            for work, fut, finish in self.pending:
                if drain or work.exchanged:
                    voted = self._advance(work, to_end=True)
                    fut.set_result(voted if finish is None else finish(voted))
                else:
                    self._advance(work, to_end=False)
                    remaining.append((work, fut, finish))
        except BaseException as error:
            for _, fut, _ in self.pending:
                if not fut.done():
                    fut.set_exception(error)
            self.pending.clear()
            raise
        self.pending = remaining

    def _advance(self, work: VoteWork | NodeVoteWork, to_end: bool) -> torch.Tensor | None:
        """One stage of ``work`` (or all); a NonFiniteError is deferred and the bucket zeroed."""
        try:
            return work.wait() if to_end else work.exchange()
        except NonFiniteError as error:  # raised on every rank alike; the work is now skipped
            self.defer(error)
            return work.wait() if to_end else None

    # -- checkpointing -------------------------------------------------------------------

    _UNPICKLED = (
        "process_group", "pending", "settings_checked", "param_keys", "bucket_calls", "deferred_error", "raise_queued",
        "layout",
    )  # fmt: skip

    @classmethod
    def _all_slots(cls) -> list[str]:
        return [slot for klass in cls.__mro__ for slot in getattr(klass, "__slots__", ())]

    def __getstate__(self) -> dict:
        # A process group cannot be pickled; like PowerSGDState, drop it and use WORLD on load.
        logger.warning(f"{type(self).__name__}: the process group is not serializable and is left out of the saved state")
        return {slot: getattr(self, slot) for slot in self._all_slots() if slot not in self._UNPICKLED}

    def __setstate__(self, state: dict) -> None:
        self.process_group = None
        self.pending = collections.deque()
        self.settings_checked = False
        self.param_keys = {}
        self.bucket_calls = 0
        self.deferred_error = None
        self.raise_queued = False
        self.layout = None
        self.buckets_seen = 0
        logger.warning(f"{type(self).__name__}: restored with the default process group (WORLD)")
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict:
        """Iteration count, world size and statistics (plain types and tensors: loads with
        ``torch.load(..., weights_only=True)``)."""
        world_size, _ = group_size_rank(self.process_group)
        return {"iter": self.iter, "world_size": world_size, "stats": self.stats.state_dict()}

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


class SignVoteState(VoteHookState):
    """State of :func:`sign_vote_hook`, in the style of PyTorch's ``PowerSGDState``.

    Args:
        process_group: as :class:`VoteHookState`.
        vote: as :class:`VoteHookState`.
        check_replicas_every: as :class:`VoteHookState`.
        momentum: Signum momentum beta in [0, 1): each worker votes
            ``sign(m)`` with ``m <- beta*m + (1-beta)*g``; 0 votes the raw gradient (signSGD-MV).
        start_iter: iterations of plain mean all-reduce before voting starts. DDP rebuilds its
            buckets after the first iteration, so per-bucket momentum needs ``start_iter >= 1``.
    """

    __slots__ = (
        # settings
        "momentum",
        "start_iter",
        # internal state
        "momentum_buffers",
        "layouts",
        "unplaced",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        momentum: float = 0.0,
        start_iter: int = 1,
        vote: VoteConfig | None = None,
        check_replicas_every: int = 0,
    ) -> None:
        super().__init__(process_group, vote=vote, check_replicas_every=check_replicas_every)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1): it is the Signum averaging factor beta")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter={start_iter!r} must be a non-negative int")
        if momentum > 0 and start_iter < 1:
            raise ValueError(
                f"start_iter={start_iter} with momentum={momentum}: per-bucket momentum needs start_iter >= 1, "
                "because DDP rebuilds its gradient buckets after the first iteration"
            )
        self.momentum = float(momentum)
        self.start_iter = start_iter
        self.momentum_buffers: dict[int, torch.Tensor] = {}  # bucket index -> [n] flat momentum
        self.layouts: dict[int, tuple[tuple[int, int, int], ...]] = {}  # bucket index -> its layout
        self.unplaced: dict[int, torch.Tensor] = {}  # key -> momentum not yet in a bucket buffer

    def settings(self) -> dict:
        return {**super().settings(), "momentum": self.momentum, "start_iter": self.start_iter}

    def _layout(self, bucket: dist.GradBucket) -> tuple[tuple[int, int, int], ...]:
        """(parameter key, offset, numel) of each parameter in the bucket's flat buffer
        (keys: :meth:`param_key`; a resumed run starts from DDP's first layout again)."""
        flat = bucket.buffer()
        layout = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            key = self.param_key(p)
            layout.append((key, (g.data_ptr() - flat.data_ptr()) // flat.element_size(), g.numel()))
        return tuple(layout)

    def begin_bucket(self, bucket: dist.GradBucket) -> None:
        super().begin_bucket(bucket)
        self._layout(bucket)  # give parameters their keys from the very first layout (warm-up too)

    def _pieces(self) -> dict[int, torch.Tensor]:
        """Every parameter's momentum, as views into the flat buffers (plus unplaced ones)."""
        pieces = dict(self.unplaced)
        for index, buf in self.momentum_buffers.items():
            for key, offset, numel in self.layouts[index]:
                pieces[key] = buf[offset : offset + numel]
        return pieces

    def momentum_buffer(self, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.Tensor:
        """The bucket's flat momentum, zero at first (float32 for half-precision gradients).

        Kept per bucket for speed, but moved parameter by parameter when DDP re-buckets.
        """
        index, layout = bucket.index(), self._layout(bucket)
        if self.layouts.get(index) != layout:
            if self.momentum_buffers:  # a new layout: release every bucket's momentum per parameter
                self.unplaced = self._pieces()
                self.momentum_buffers, self.layouts = {}, {}
            dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
            buf = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
            for key, offset, numel in layout:
                piece = self.unplaced.pop(key, None)
                if piece is not None:
                    if piece.numel() != numel:
                        raise ValueError(
                            f"the loaded momentum of parameter {key} has {piece.numel()} entries, the parameter "
                            f"{numel}: the checkpoint is of another model"
                        )
                    buf[offset : offset + numel] = piece.reshape(-1)
            self.momentum_buffers[index], self.layouts[index] = buf, layout
        return self.momentum_buffers[index]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # Per parameter, like state_dict: parameter keys, not bucket layouts, survive a restart.
        state.update(momentum_buffers={}, layouts={}, unplaced=self._pieces())
        return state

    def state_dict(self) -> dict:
        """Iteration count, momentum per parameter (cloned) and statistics."""
        return {**super().state_dict(), "momentum": {k: v.detach().clone() for k, v in self._pieces().items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        for key, value in state_dict["momentum"].items():
            if not (torch.is_tensor(value) and value.is_floating_point()):
                kind = value.dtype if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"the checkpoint's momentum of parameter {key} is {kind}; expected a float tensor")
        super().load_state_dict(state_dict)
        self.momentum_buffers, self.layouts = {}, {}
        self.unplaced = {int(k): v.detach().clone() for k, v in state_dict["momentum"].items()}


def _raise_after_backward(state: VoteHookState) -> bool:
    """Queue a check that raises ``state.deferred_error`` after DDP has finished this backward.

    DDP queues its own end-of-backward callback only after the last bucket's hook has run, so a
    callback queued now runs before DDP's; that one queues the check, which thus runs after it.
    Returns False outside a backward pass (a hook called by hand), where nothing is queued.
    """
    engine = torch.autograd.Variable._execution_engine

    def check() -> None:
        error, state.deferred_error = state.deferred_error, None
        if error is not None:
            state.raised += 1
            raise error

    try:
        engine.queue_callback(lambda: engine.queue_callback(check))
    except RuntimeError:
        return False
    return True


def allreduce_mean(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    nonfinite: str | None = "skip",
    on_error: Callable[[NonFiniteError], None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce, in place) as a future; counts ring bytes.

    A non-finite mean (identical on every rank) is zeroed and counted in ``stats.skipped``
    (``nonfinite="skip"``), raises ``NonFiniteError`` (``"raise"``; handed to ``on_error``
    instead, with the mean zeroed, when given), or is left for the optimizer (``None``).
    """
    world_size, _ = group_size_rank(group)
    if stats is not None:
        ring = 2 * (world_size - 1) * tensor.numel() * tensor.element_size() // world_size
        stats.calls += 1
        stats.add(ring, ring)
    tensor.div_(world_size)

    def checked(mean: torch.Tensor) -> torch.Tensor:
        if nonfinite is not None and bool(nonfinite_flag(mean)):
            mean.zero_()
            if stats is not None:
                stats.skipped += 1
            if nonfinite == "raise":
                error = NonFiniteError("NaN or Inf in the all-reduced gradient (some rank's gradient was non-finite)")
                if on_error is None:
                    raise error
                on_error(error)
        return mean

    if world_size == 1:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(checked(tensor))
        return fut
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: checked(f.value()[0]))


def allreduce_hook(state: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce over WORLD) with its bytes counted in ``state``.

    The fp32 baseline the benchmarks measure the vote against: ``model.register_comm_hook(CommStats(), allreduce_hook)``.
    """
    return allreduce_mean(bucket.buffer(), None, state)


def sign_vote_hook(state: SignVoteState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Replace the bucket's gradient with the majority vote of the workers' (momentum) signs."""
    grad = bucket.buffer()  # [n] flat gradients of this bucket
    if grad.is_sparse:
        raise ValueError("sign_vote_hook got a sparse gradient bucket; sparse gradients are not supported")
    state.begin_bucket(bucket)
    if state.iter < state.start_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_mean(grad, state.process_group, state.stats, state.nonfinite, on_error=state.defer)
    if state.node_layout() is not None:  # momentum on the node's mean gradient
        prepare = None
        if state.momentum > 0:
            buf = state.momentum_buffer(bucket, grad)
            prepare = lambda mean: (buf, advance_momentum(buf, mean, state.momentum))  # noqa: E731
        return state.vote(bucket, grad, out=grad, prepare=prepare)
    voter, bad = grad, None
    if state.momentum > 0:
        voter = state.momentum_buffer(bucket, grad)
        bad = advance_momentum(voter, grad, state.momentum)
    return state.vote(bucket, voter, out=grad, input_nonfinite=bad)


def advance_momentum(buf: torch.Tensor, grad: torch.Tensor, beta: float) -> torch.Tensor:
    """``buf <- beta*buf + (1-beta)*grad`` unless ``grad`` holds NaN or Inf; returns that flag.

    A non-finite gradient never enters the momentum; the flag goes into the vote's header so
    every rank skips the bucket. On CPU the check is one summing pass; on a GPU the update is a
    select on the device (no host synchronisation).
    """
    bad = nonfinite_flag(grad)
    if grad.device.type == "cpu":
        if not bool(bad):
            buf.mul_(beta).add_(grad, alpha=1.0 - beta)
    else:
        buf.copy_(torch.where(bad, buf, buf * beta + grad * (1.0 - beta)))
    return bad
