"""Run a communication hook without DDP, overlapped with the backward pass.

DDP starts reducing a bucket of gradients as soon as all of its gradients are ready, so the
communication of the last layers overlaps the backward pass of the first. Where there is no DDP
(a DeepSpeed engine whose own all-reduce is off, a hand-written loop), :class:`BackwardReducer`
does the same for any hook with DDP's contract ``hook(state, bucket) -> Future[Tensor]``: a
post-accumulate-grad hook on every parameter marks it ready, a bucket whose parameters are all
ready is copied into its flat buffer and handed to the hook, buckets are handed over in index
order (the same sequence of collectives on every rank), and once backward is done every future
is waited for and its result written back into ``param.grad``. So after ``loss.backward()``
the gradients hold the reduced values, exactly as under DDP, and the hook's own pipelining
(``VoteHookState``: the second transport step of one bucket overlaps the next bucket) works unchanged.

Gradient accumulation: ``sync`` says whether the current backward ends an accumulation window
(DeepSpeed: ``engine.is_gradient_accumulation_boundary``); backward passes before it only
accumulate into ``.grad`` and communicate nothing, like DDP's ``no_sync()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["BackwardReducer", "ReadyBucket"]

_MB = 1024 * 1024


class ReadyBucket:
    """The part of ``torch.distributed.GradBucket`` the hooks use, for a bucket filled here."""

    __slots__ = ("_index", "_buffer", "_params", "_grads", "_last")

    def __init__(self, index: int, params: list[torch.Tensor], last: bool) -> None:
        sizes = [p.numel() for p in params]
        self._index = index
        self._params = params
        self._last = last
        self._buffer = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)  # [n]
        self._grads = [piece.view_as(p) for piece, p in zip(self._buffer.split(sizes), params)]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        """Views of each parameter's gradient inside :meth:`buffer`."""
        return self._grads

    def is_last(self) -> bool:
        return self._last


def _buckets(params: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int) -> list[list[torch.Tensor]]:
    """Parameters in reverse order (about the order backward produces their gradients), cut into
    buckets of at most ``cap_bytes`` (the first one smaller, to start communicating early), one
    dtype and device per bucket."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(params):
        cap = first_cap_bytes if not buckets else cap_bytes
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class BackwardReducer:
    """Reduce gradients with ``hook(state, bucket)`` bucket by bucket as backward produces them.

    Args:
        params: the parameters to reduce (those with ``requires_grad``; each tensor once).
        state: the hook's state (e.g. ``SignVoteState`` or ``SignMuon.comm_state``).
        hook: a DDP communication hook, ``(state, bucket) -> Future[Tensor]``.
        bucket_cap_mb: bucket size (DDP's default, 25 MB); the first bucket is at most
            ``first_bucket_cap_mb`` (1 MB), so communication starts early in backward.
        sync: called when backward produces a gradient; False means this backward does not end
            a gradient-accumulation window (nothing is sent, gradients accumulate). None: always.

    A parameter without a gradient in a synchronised backward (unused this step) takes part with
    zeros, so every rank hands the hook the same buckets; voters treat a 0 as an abstention. Every
    ``.grad`` becomes a view into its bucket's buffer (like DDP's ``gradient_as_bucket_view``) and
    holds the reduced value after backward. Call :meth:`remove` to detach.
    """

    __slots__ = (
        # settings
        "state",
        "hook",
        "sync",
        # internal state
        "buckets",
        "bucket_of",
        "ready",
        "next_bucket",
        "futures",
        "armed",
        "handles",
        # statistics
        "backward_passes",
    )

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        state: Any,
        hook: Callable[[Any, Any], torch.futures.Future],
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        sync: Callable[[], bool] | None = None,
    ) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} and first_bucket_cap_mb={first_bucket_cap_mb} must be > 0")
        unique: dict[int, torch.Tensor] = {}
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__}")
            if p.requires_grad:
                unique.setdefault(id(p), p)  # tied weights: one entry
        if not unique:
            raise ValueError("BackwardReducer got no parameter that requires a gradient")
        for p in unique.values():
            if p.layout != torch.strided or not p.is_floating_point():
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is {p.layout} {p.dtype}; only dense float parameters can be reduced"
                )
        self.state = state
        self.hook = hook
        param_key = getattr(state, "param_key", None)
        if callable(param_key):
            # DDP's first bucket lists the parameters in registration order, which is how our
            # hook states key tie-break coins and momentum: the same keys here give the same
            # vote as under DDP, and checkpoints that move between the two.
            for p in unique.values():
                param_key(p)
        self.sync = sync
        groups = _buckets(list(unique.values()), int(bucket_cap_mb * _MB), int(first_bucket_cap_mb * _MB))
        self.buckets = [ReadyBucket(i, ps, last=i == len(groups) - 1) for i, ps in enumerate(groups)]
        self.bucket_of = {id(p): i for i, ps in enumerate(groups) for p in ps}
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.futures: list[torch.futures.Future] = []
        self.armed = False
        self.backward_passes = 0  # synchronised backward passes reduced so far
        self.handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in unique.values()]

    def _on_ready(self, param: torch.Tensor) -> None:
        if not self.armed:
            if self.sync is not None and not self.sync():
                return  # inside an accumulation window: only accumulate
            # Runs once the whole backward is done (after every gradient has accumulated).
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.armed = True
        self.ready[self.bucket_of[id(param)]] += 1
        self._launch(force=False)

    def _launch(self, force: bool) -> None:
        """Hand complete buckets to the hook in index order (all remaining ones if ``force``)."""
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if not force and self.ready[self.next_bucket] < len(bucket.parameters()):
                return
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                # Each .grad becomes a view into the bucket (as DDP's gradient_as_bucket_view):
                # later backward passes accumulate in place and a hook that reduces in place
                # leaves nothing to copy back.
                if p.grad is None:
                    g.zero_()
                elif p.grad.data_ptr() != g.data_ptr():
                    g.copy_(p.grad)
                p.grad = g
            self.futures.append(self.hook(self.state, bucket))
            self.next_bucket += 1

    def _finish(self) -> None:
        try:
            self._launch(force=True)  # buckets with unused parameters
            for bucket, fut in zip(self.buckets, self.futures):
                reduced = fut.wait()  # [n] the bucket's reduced flat gradient
                if reduced.data_ptr() != bucket.buffer().data_ptr():
                    bucket.buffer().copy_(reduced)
            self.backward_passes += 1
        finally:
            self.ready = [0] * len(self.buckets)
            self.next_bucket = 0
            self.futures = []
            self.armed = False

    def remove(self) -> None:
        """Detach from the parameters (no further reduction)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
