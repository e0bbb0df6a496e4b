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

With ``VoteConfig(hierarchical=True)`` the hook votes node-aware (``vote.node_vote``):
gradients are averaged inside each node in full precision and only the node means' signs are
voted between nodes; Signum's momentum then follows the node mean.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist

from .allreduce import allreduce_mean
from .hook_state import VoteHookState
from .momentum import advance_momentum
from .dist import nonfinite_flag
from .vote import MomentumStep, VoteConfig

__all__ = ["SignVoteState", "sign_vote_hook"]


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
            placed = {key for other in self.layouts.values() for key, _, _ in other}
            if index in self.layouts or any(key in placed for key, _, _ in layout):
                # Re-bucketed (this bucket changed, or holds parameters another one held):
                # release every bucket's momentum per parameter. A bucket merely not seen yet
                # (the first step of each) joins the others.
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
    if state.momentum == 0:
        return state.vote(bucket, grad, out=grad)
    # The momentum advances while it is packed (one pass on a GPU); a NaN gradient leaves it.
    bad = nonfinite_flag(grad)
    step = MomentumStep(grad, 1.0 - state.momentum, bad)
    return state.vote(bucket, state.momentum_buffer(bucket, grad), out=grad, input_nonfinite=bad, momentum=step)
