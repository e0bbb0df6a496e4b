"""DDP communication hook for SignMuon: the worker-side half of the optimizer.

Each worker turns its *local* gradient into its Muon direction (momentum, Newton–Schulz) and
only the signs of that direction are voted, so this part must see the gradient before any
averaging: it runs here, overlapped with the backward pass. The post-vote half (optional
polar step, the update) runs in ``SignMuon.step()``. Register it with one call::

    opt = SignMuon(model.parameters(), lr=2e-3)
    model = DDP(model)
    opt.register_comm_hook(model)

The math itself lives in the optimizer (``signmuon.optim``), reached through the
:class:`WorkerDirections` protocol; this module only routes each bucket's gradients through it
and through the vote collective, so neither is copied here.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from typing import Protocol

import torch
import torch.distributed as dist

from .allreduce import mean_all_reduce_future
from .dist import flatten, unflatten_into
from .hook_guards import refuse_per_parameter_call
from .hook_state import VoteHookState
from .vote import NodeLayout, OwnedVoteWork, VoteConfig, mean_node_aware

__all__ = ["SignMuonHookState", "sign_muon_hook", "WorkerDirections"]


class WorkerDirections(Protocol):
    """What the hook needs from the optimizer (``signmuon.optim.SignMuon`` provides it)."""

    def votes(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s update is voted (else its gradient is mean all-reduced)."""

    def local_direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Advance ``param``'s momentum with this worker's ``grad``; return the direction to vote."""

    def owner(self, param: torch.Tensor, ranks_per_node: int) -> int:
        """The local rank that owns ``param``'s momentum in the node-aware vote (fixed per optimizer)."""

    @property
    def steps_taken(self) -> int:
        """Optimizer steps so far: the iteration counter the hook votes under."""

    @property
    def grad_scaler(self):
        """The ``torch.amp.GradScaler`` the optimizer trains under, or None."""


class SignMuonHookState(VoteHookState):
    """State of :func:`sign_muon_hook`: the vote settings plus the optimizer owning the math.

    Made by ``SignMuon.register_comm_hook`` (or ``SignMuon.comm_state``), which is how the
    optimizer learns that the hook, not ``step()``, does the pre-vote part.

    One iteration counter: the hook's ``iter`` is the optimizer's ``steps_taken`` plus the
    backward passes the hook has finished since the last step (``passes``: 0 during backward, 1
    between the last bucket and ``step()``, which checks it and sets it back to 0).

    Under the optimizer's GradScaler (``opt.use_grad_scaler``) each pass reads the scale at its
    first bucket and divides the voted gradients by it before their direction; a vote skipped
    for NaN or Inf is handed on as NaN (the scaler then skips the step and backs off on every
    rank); a pass followed by a lower scale and no step was such a skipped step, and is dropped.
    """

    __slots__ = ("optimizer", "passes", "raised_seen", "skipped_seen", "scale", "hooked")
    _UNPICKLED = VoteHookState._UNPICKLED + ("optimizer", "iter", "scale")

    def __init__(
        self,
        optimizer: WorkerDirections,
        process_group: dist.ProcessGroup | None = None,
        *,
        vote: VoteConfig | None = None,
        check_replicas_every: int = 0,
    ) -> None:
        if not (callable(getattr(optimizer, "votes", None)) and callable(getattr(optimizer, "local_direction", None))):
            raise TypeError(
                f"SignMuonHookState needs the SignMuon optimizer, got {type(optimizer).__name__}; "
                "create it with opt.register_comm_hook(ddp_model)"
            )
        self.optimizer = optimizer
        super().__init__(process_group, vote=vote, check_replicas_every=check_replicas_every)
        self.passes = 0
        self.raised_seen = 0  # ``raised`` at the last step: passes since then that raised
        self.skipped_seen = 0  # ``stats.skipped`` at the last step: votes skipped since then
        self.hooked: set[int] = set()  # ids of the parameters a bucket ever held (DDP's, fixed when it is built)

    def _start_process_state(self) -> None:
        super()._start_process_state()
        self.scale: float | None = None  # the GradScaler's scale at this pass's first bucket (None: none)

    def begin_bucket(self, bucket: dist.GradBucket) -> None:
        if self.bucket_calls == 0:
            self.read_scale()
        super().begin_bucket(bucket)

    def read_scale(self) -> None:
        """At a pass's first bucket: the scale of the optimizer's enabled GradScaler (alike on every
        rank). Lower than at a pass that no step followed, the scaler skipped that step (it found
        NaN or Inf, handed on by us or its own) and backed off: that pass is dropped."""
        scaler = getattr(self.optimizer, "grad_scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        if scale is not None and self.passes and self.scale is not None and scale < self.scale:
            self.stepped()
        self.scale = scale

    @property
    def inverse_scale(self) -> float | None:
        """What this pass's voted gradients are multiplied by before their direction (None: 1)."""
        return None if self.scale is None or self.scale == 1.0 else 1.0 / self.scale

    def hand_skipped(self, bucket: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:  # the scaler's check must find it, on every rank alike
            bucket.fill_(float("nan"))
        return bucket

    def check_one_pass(self, name: str) -> None:
        """For ``name.step()``: raise unless exactly one backward pass ran the hook since the
        last step (a pass that raised ``NonFiniteError``, caught by the user, counts as one)."""
        raised = self.raised - self.raised_seen
        ran = self.passes - raised
        if ran == 0 and raised:
            ran = 1  # a step on the zeroed gradients of a failed backward moves nothing voted
        if ran == 0:
            raise RuntimeError(
                f"{name}.step(): sign_muon_hook has not run since the last step; call backward() "
                "through the DDP model the hook is registered on before step()"
            )
        if ran > 1:
            raise RuntimeError(
                f"{name}.step(): sign_muon_hook ran {ran} times since the last step, advancing the "
                "momentum each time; accumulate micro-batches with their forward and backward under "
                "ddp_model.no_sync()"
            )
        self.raised_seen = self.raised

    def skipped_since_step(self) -> bool:
        """Whether a vote since the last step was skipped (NaN or Inf on some rank, the same on
        every rank): ``step()`` then moves no voted parameter, as one vote of the whole step would."""
        return self.stats.skipped != self.skipped_seen

    def stepped(self) -> None:
        """The optimizer stepped (or loaded a checkpoint): no pass is pending."""
        self.passes = 0
        self.raised_seen = self.raised
        self.skipped_seen = self.stats.skipped

    @property
    def iter(self) -> int:
        return self.optimizer.steps_taken + self.passes

    @iter.setter
    def iter(self, value: int) -> None:
        # The base class counts passes as iterations (``iter += 1`` after the last bucket).
        self.passes = value - self.optimizer.steps_taken

    def settings(self) -> dict:
        optimizer_settings = getattr(self.optimizer, "settings", None)
        return {**super().settings(), "optimizer": optimizer_settings() if callable(optimizer_settings) else None}


def sign_muon_hook(state: SignMuonHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Vote the signs of each worker's SignMuon direction; AdamW-routed gradients are averaged.

    Writes each voted parameter's local direction over its gradient in the bucket, votes it,
    and hands DDP the vote (entries in {-1, 0, +1}); ``SignMuon.step()`` applies it.
    """
    if not isinstance(state, SignMuonHookState):
        raise TypeError(
            f"sign_muon_hook needs a SignMuonHookState, got {type(state).__name__}: register it with "
            "opt.register_comm_hook(ddp_model) (or ddp_model.register_comm_hook(opt.comm_state, sign_muon_hook))"
        )
    refuse_per_parameter_call(bucket, "sign_muon_hook")
    grad = bucket.buffer()  # [n] this bucket's flat gradients
    if grad.is_sparse:
        raise ValueError("sign_muon_hook got a sparse gradient bucket; sparse gradients are not supported")
    state.begin_bucket(bucket)
    opt = state.optimizer
    params, grads = bucket.parameters(), bucket.gradients()  # grads: views into `grad`
    state.hooked.update(map(id, params))
    voted = [opt.votes(p) for p in params]
    layout = state.node_layout()
    if layout is not None:
        return _node_aware(state, bucket, layout, voted)
    inverse_scale = state.inverse_scale
    for p, g, v in zip(params, grads, voted):
        if v:
            direction = opt.local_direction(p, g if inverse_scale is None else g.mul_(inverse_scale))
            if direction is not g:  # signSGD's direction is the gradient itself
                g.copy_(direction)
    if all(voted):
        return state.vote(bucket, grad, out=grad)
    if not any(voted):
        state.pending.advance(drain=bucket.is_last())  # earlier buckets' votes must still finish
        fut = mean_all_reduce_future(grad, state.process_group, state.stats, None)  # SignMuon's AdamW path checks
        state.maybe_increase_iter(bucket)
        return fut
    # A bucket mixing both kinds: vote one part, all-reduce the other, both issued now.
    averaged = [g for g, v in zip(grads, voted) if not v]
    flat_avg = flatten(averaged)
    avg_fut = mean_all_reduce_future(flat_avg, state.process_group, state.stats, None)  # in place
    voters = [g for g, v in zip(grads, voted) if v]
    flat_vote = flatten(voters)

    def finish(vote: torch.Tensor) -> torch.Tensor:
        avg_fut.wait()
        unflatten_into(vote, voters)
        unflatten_into(flat_avg, averaged)
        return grad

    return state.vote(bucket, flat_vote, out=flat_vote, finish=finish, voted=voted)


def _node_aware(
    state: SignMuonHookState, bucket: dist.GradBucket, layout: NodeLayout, voted: list[bool]
) -> torch.futures.Future[torch.Tensor]:
    """SignMuon with ``VoteConfig(hierarchical=True)``: the node's mean gradient, each matrix's
    momentum and Newton–Schulz on the one local rank that owns it, signs voted between nodes.

    Pipelined like the flat hook (:class:`~signmuon.comm_hooks.vote.OwnedVoteWork`): the node's
    all-reduce starts in this call; the owners' Newton–Schulz and the rail vote run at the
    next bucket's call, the gather inside the node at the one after, or all of it when the last
    bucket drains the pipeline. AdamW-routed gradients are averaged here, before it returns.
    """
    state.pending.advance()
    opt = state.optimizer
    params, grads = bucket.parameters(), bucket.gradients()
    vote_idx = [j for j, v in enumerate(voted) if v]
    work = None
    inverse_scale = state.inverse_scale
    if vote_idx:
        label, tag = f"bucket {bucket.index()} (iteration {state.iter})", (state.iter << 20) | bucket.index()
        work = OwnedVoteWork(
            [grads[j] for j in vote_idx],
            lambda i, mean: opt.local_direction(
                params[vote_idx[i]], mean if inverse_scale is None else mean.mul_(inverse_scale)
            ),
            [opt.owner(params[j], layout.ranks_per_node) for j in vote_idx],
            [state.param_key(params[j]) for j in vote_idx],
            layout,
            state.vote_config,
            step=state.iter,
            stats=state.stats,
            label=label,
            tag=tag,
        )
    averaged = [grads[j] for j, v in enumerate(voted) if not v]
    if averaged:
        flat = flatten(averaged)
        mean_node_aware(flat, layout, state.stats)  # SignMuon's AdamW path checks finiteness
        unflatten_into(flat, averaged)
    grad = bucket.buffer()
    if work is not None:
        return state.track(bucket, work, lambda _: grad)
    if bucket.is_last():
        state.pending.advance(drain=True)  # earlier buckets' votes must still finish
    state.maybe_increase_iter(bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[grad.device] if grad.is_cuda else None)
    fut.set_result(grad)
    return fut
