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

Host synchronisations per bucket on a GPU: one in the common case, two at most. The first reads
the headers of the vote's first transport step (they decide the NaN/Inf skip and the sizes of the
optional zero lists); only where zeros travel, or ties vote 0 (``tie="exact"``, an even number of
ranks), a second reads the voted result's zero codes. Until the first vote (and after a load),
one more per iteration agrees on the iteration counter; later the headers carry it. Signum's
finiteness check of the gradient stays on the device.

With ``VoteConfig(hierarchical=True)`` the hook votes node-aware (``vote.node_vote``):
gradients are averaged inside each node in full precision and only the node means' signs are
voted between nodes; Signum's momentum then follows the node mean, and each local rank keeps
only the slice of it that it votes (1/L of the bucket, L ranks per node).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist

from .allreduce import mean_all_reduce_future
from .dist import group_size_rank, nonfinite_flag
from .hook_guards import refuse_per_parameter_call
from .hook_state import VoteHookState
from .kernels.bits import advance_momentum_unless
from .vote import MomentumStep, VoteConfig, merge_in_node, node_slice

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
        "buffer_starts",
        "unplaced",
        "unplaced_starts",
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
        self.momentum_buffers: dict[int, torch.Tensor] = {}  # bucket index -> flat momentum of its entries held here
        self.layouts: dict[int, tuple[tuple[int, int, int], ...]] = {}  # bucket index -> its layout
        self.buffer_starts: dict[int, int] = {}  # bucket index -> its first entry held here (node-aware: a slice)
        self.unplaced: dict[int, torch.Tensor] = {}  # key -> momentum not yet in a bucket buffer
        self.unplaced_starts: dict[int, int] = {}  # key -> where a partial piece starts in its parameter

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

    def _pieces(self) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """The momentum held here per parameter, as views into the buffers (plus unplaced
        pieces), and where each partial piece starts inside its parameter (node-aware: this
        rank holds its slice of each bucket, so a parameter may be split over the node)."""
        pieces, starts = dict(self.unplaced), dict(self.unplaced_starts)
        for index, buf in self.momentum_buffers.items():
            lo = self.buffer_starts[index]
            hi = lo + buf.numel()
            for key, offset, numel in self.layouts[index]:
                first, stop = max(offset, lo), min(offset + numel, hi)
                if first >= stop:
                    continue
                pieces[key] = buf[first - lo : stop - lo]
                if stop - first < numel:
                    starts[key] = first - offset
        return pieces, starts

    def momentum_buffer(self, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.Tensor:
        """The bucket's flat momentum, zero at first (float32 for half-precision gradients);
        node-aware, only the slice of entries this rank votes (``vote.node_slice``).

        Kept per bucket for speed, but moved parameter by parameter when DDP re-buckets (and
        node-aware, merged over the node's ranks, whose slices then cut the parameters anew).
        """
        index, layout = bucket.index(), self._layout(bucket)
        if self.layouts.get(index) != layout:
            placed = {key for other in self.layouts.values() for key, _, _ in other}
            if index in self.layouts or any(key in placed for key, _, _ in layout):
                # Re-bucketed (this bucket changed, or holds parameters another one held):
                # release every bucket's momentum per parameter. A bucket merely not seen yet
                # (the first step of each) joins the others.
                self.unplaced, self.unplaced_starts = self._pieces()
                self.momentum_buffers, self.layouts, self.buffer_starts = {}, {}, {}
            node = self.node_layout()
            dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
            whole = torch.zeros(grad.numel(), dtype=dtype, device=grad.device)
            held = torch.zeros(grad.numel(), dtype=torch.bool, device=grad.device)
            for key, offset, numel in layout:
                piece = self.unplaced.pop(key, None)
                start = self.unplaced_starts.pop(key, 0)
                if piece is None:
                    continue
                fits = start + piece.numel() <= numel
                if not fits or (node is None and piece.numel() != numel):
                    why = (
                        "the checkpoint is of another model"
                        if not fits
                        else "a slice saved by the node-aware vote: resume with the same VoteConfig"
                    )
                    raise ValueError(
                        f"the loaded momentum of parameter {key} holds entries [{start}, {start + piece.numel()}) "
                        f"of its {numel}: {why}"
                    )
                whole[offset + start : offset + start + piece.numel()] = piece.reshape(-1)
                held[offset + start : offset + start + piece.numel()] = True
            lo, hi = 0, grad.numel()
            if node is not None:
                merge_in_node(whole, held, node, self.stats)
                lo, hi = node_slice(grad.numel(), node)
            self.momentum_buffers[index] = whole[lo:hi].clone() if hi - lo < grad.numel() else whole.view(grad.shape)
            self.layouts[index], self.buffer_starts[index] = layout, lo
        return self.momentum_buffers[index]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # Per parameter, like state_dict: parameter keys, not bucket layouts, survive a restart.
        pieces, starts = self._pieces()
        state.update(momentum_buffers={}, layouts={}, buffer_starts={}, unplaced=pieces, unplaced_starts=starts)
        return state

    def state_dict(self) -> dict:
        """Iteration count, momentum per parameter (cloned) and statistics. Node-aware, each rank
        holds its slice of the node's momentum: ``momentum_starts`` says where a partial piece
        starts inside its parameter; resume every rank from its own state."""
        pieces, starts = self._pieces()
        return {
            **super().state_dict(),
            "momentum": {k: v.detach().clone() for k, v in pieces.items()},
            "momentum_starts": dict(starts),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`; raises ValueError if it was saved on another world size,
        holds other than float tensors or bad starts, or holds momentum another rank saved."""
        for key, value in state_dict["momentum"].items():
            if not (torch.is_tensor(value) and value.is_floating_point()):
                kind = value.dtype if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"the checkpoint's momentum of parameter {key} is {kind}; expected a float tensor")
        starts = {int(k): v for k, v in state_dict.get("momentum_starts", {}).items()}
        for key, start in starts.items():
            if isinstance(start, bool) or not isinstance(start, int) or start < 0 or key not in state_dict["momentum"]:
                raise ValueError(
                    f"the checkpoint's momentum start of parameter {key} is {start!r}; expected an int >= 0 "
                    "of a parameter it holds momentum for"
                )
        _, rank = group_size_rank(self.process_group)
        saved_rank = int(state_dict.get("rank", rank))
        if state_dict["momentum"] and saved_rank != rank:
            raise ValueError(
                f"rank {rank} is loading the hook state rank {saved_rank} saved: each rank's momentum (node-aware: "
                "its slice of the node's) is its own, so load every rank's own state (e.g. a file per rank)"
            )
        super().load_state_dict(state_dict)
        self.momentum_buffers, self.layouts, self.buffer_starts = {}, {}, {}
        self.unplaced = {int(k): v.detach().clone() for k, v in state_dict["momentum"].items()}
        self.unplaced_starts = starts


def sign_vote_hook(state: SignVoteState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Replace the bucket's gradient with the majority vote of the workers' (momentum) signs."""
    refuse_per_parameter_call(bucket, "sign_vote_hook")
    grad = bucket.buffer()  # [n] flat gradients of this bucket
    if grad.is_sparse:
        raise ValueError("sign_vote_hook got a sparse gradient bucket; sparse gradients are not supported")
    state.begin_bucket(bucket)
    if state.iter < state.start_iter:
        state.maybe_increase_iter(bucket)
        return mean_all_reduce_future(grad, state.process_group, state.stats, state.nonfinite, on_error=state.defer)
    state.voted_grads.voted(bucket, "sign_vote_hook")
    if state.momentum == 0:
        return state.vote(bucket, grad, out=grad)
    if state.node_layout() is not None:  # momentum on the node's mean gradient, this rank's slice of it
        return state.vote(bucket, grad, out=grad, node_momentum=(state.momentum_buffer(bucket, grad), state.momentum))
    bad = nonfinite_flag(grad)
    buf = state.momentum_buffer(bucket, grad)
    present = _present_entries(state, bucket)
    if present is None:
        # The momentum advances while it is packed (one pass on a GPU); a NaN gradient leaves it.
        step = MomentumStep(grad, 1.0 - state.momentum, bad)
        return state.vote(bucket, buf, out=grad, input_nonfinite=bad, momentum=step)
    # A parameter without a gradient here (all zeros from DDP) abstains: lerp toward the momentum
    # itself leaves it exactly, and it votes 0.
    advance_momentum_unless(buf, torch.where(present, grad.to(buf.dtype), buf), 1.0 - state.momentum, bad)
    return state.vote(bucket, buf * present, out=grad, input_nonfinite=bad)


def _present_entries(state: SignVoteState, bucket: dist.GradBucket) -> torch.Tensor | None:
    """Per entry of the bucket, whether its parameter has a gradient on this rank (not zero
    everywhere, which is what DDP hands a joined rank or one that did not use the parameter);
    None where every parameter has one for sure: known without reading the device."""
    if not (state.gradients_may_lack or _outside_backward()):
        return None  # DDP without find_unused_parameters, inside backward: every parameter has one
    grad = bucket.buffer()
    layout = state._layout(bucket)
    flags = torch.stack([grad[offset : offset + numel].ne(0).any() for _, offset, numel in layout])
    mask = torch.ones(grad.numel(), dtype=torch.bool, device=grad.device)
    for (_, offset, numel), flag in zip(layout, flags):
        mask[offset : offset + numel] = flag
    return mask


def _outside_backward() -> bool:
    """Whether no backward pass is running: DDP's ``Join`` calls the hook of a joined rank so, on zeros."""
    return torch._C._current_graph_task_id() == -1
