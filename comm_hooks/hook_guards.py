"""The errors a vote hook raises outside its own call, where they leave training usable: a
``NonFiniteError`` once DDP has finished the backward (:class:`DeferredErrors`), and a hook that
never ran, at the optimizer's first step (:func:`watch_first_step`)."""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from .dist import NonFiniteError

__all__ = ["CountsHookCalls", "DeferredErrors", "VotedGradients", "refuse_per_parameter_call", "watch_first_step"]


class CountsHookCalls(Protocol):
    """What :func:`watch_first_step` reads of a hook state (:class:`~signmuon.comm_hooks.hook_state.VoteHookState`)."""

    buckets_seen: int
    """Hook calls ever."""


class DeferredErrors:
    """The ``NonFiniteError`` of a backward pass, raised once DDP has finished it (raising inside
    DDP's hook would leave DDP's reducer broken)."""

    __slots__ = ("error", "flags", "queued", "raised")

    def __init__(self) -> None:
        self.error: NonFiniteError | None = None
        self.flags: list[tuple[torch.Tensor, NonFiniteError]] = []  # raised if a flag is set, read then
        self.queued = False  # whether a callback raises them at the end of this backward
        self.raised = 0  # backward passes that raised

    def arm(self) -> None:
        """Queue the check that raises after DDP has finished this backward.

        DDP queues its own end-of-backward callback only after the last bucket's hook has run, so
        a callback queued now runs before DDP's; that one queues the check, which thus runs after
        it. Outside a backward pass (a hook called by hand) nothing is queued."""
        engine = torch.autograd.Variable._execution_engine
        try:
            engine.queue_callback(lambda: engine.queue_callback(self._check))
        except RuntimeError:
            self.queued = False
            return
        self.queued = True

    def defer(self, error: NonFiniteError, flag: torch.Tensor | None = None) -> None:
        """Keep ``error`` to raise after the backward; with ``flag`` (0-d bool, not read yet), only
        if it is set, read then. Outside a backward pass it raises at once (when set)."""
        if not self.queued:
            if flag is None or bool(flag):
                raise error  # not inside a backward pass: nothing to protect
            return
        if flag is not None:
            self.flags.append((flag, error))
        elif self.error is None:
            self.error = error

    def _check(self) -> None:
        error, self.error = self.error, None
        flags, self.flags = self.flags, []
        if error is None and flags and bool(torch.stack([flag for flag, _ in flags]).any()):  # one read
            error = next(e for flag, e in flags if bool(flag))
        if error is not None:
            self.raised += 1
            raise error


class VotedGradients:
    """Refuses a synchronised backward into gradients that still hold the last vote.

    Without ``no_sync``, a second backward before the gradients are cleared adds this
    micro-batch's gradient to the vote DDP wrote, and votes that: neither the vote of the summed
    gradients nor a sum of votes. The hook cannot see the optimizer, so it watches the gradient:
    after each voted backward it notes each bucket's first gradient (the tensor and its version
    counter); a hook on that parameter, which runs before autograd accumulates into it, raises
    where the same tensor comes back untouched (``zero_grad`` sets it to None or bumps the
    version). No device read; the same decision on every rank, which all run the same loop."""

    __slots__ = ("marks", "watched")

    def __init__(self) -> None:
        self.marks: dict[int, tuple[weakref.ref, int]] = {}  # id(parameter) -> (its voted .grad, version)
        self.watched: set[int] = set()  # parameters with the hook

    def voted(self, bucket, hook: str) -> None:
        """Note ``bucket``'s first gradient once DDP has written this backward's vote into it."""
        param = bucket.parameters()[0]
        if id(param) not in self.watched:
            self.watched.add(id(param))
            param.register_hook(lambda grad, param=param: self._check(param, hook))
        engine = torch.autograd.Variable._execution_engine
        try:  # after DDP's end-of-backward callback, which copies the vote into .grad
            engine.queue_callback(lambda: engine.queue_callback(lambda: self._note(param)))
        except RuntimeError:
            pass  # outside a backward pass (a joined rank's call): DDP writes no gradient

    def _note(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.marks[id(param)] = (weakref.ref(param.grad), param.grad._version)  # weak: zero_grad frees it

    def _check(self, param: torch.Tensor, hook: str) -> None:
        mark = self.marks.pop(id(param), None)
        if mark is not None and param.grad is not None and param.grad is mark[0]() and param.grad._version == mark[1]:
            raise RuntimeError(
                f"{hook}: a second synchronised backward before the gradients were cleared would vote this "
                "micro-batch's gradient plus the last vote: accumulate micro-batches with their forward and backward "
                "under ddp_model.no_sync() (the vote then runs once, on their sum), and call optimizer.zero_grad() "
                "after each step"
            )


def watch_first_step(state: CountsHookCalls, optimizer: torch.optim.Optimizer, fix: str) -> None:
    """Hooks on ``optimizer``'s step that raise at its first step if ``state``'s hook has not run.

    Frameworks can drop a registered hook without a word (one registers comm hooks on CUDA only,
    one ignores hooks it does not know): training then goes on with unreduced local gradients and
    the replicas drift apart. Checked once; later steps are not watched. A step given a closure
    (Lightning's) runs backward inside ``step()``, so that step is checked when it returns."""
    seen = state.buckets_seen
    handles: list = []

    def check(opt: torch.optim.Optimizer) -> None:
        for handle in handles:
            handle.remove()
        if state.buckets_seen == seen:
            raise RuntimeError(
                f"{type(opt).__name__}.step(): the {type(state).__name__} communication hook has not run since it "
                "was registered, so the gradients were never voted and each rank would train alone. "
                + (fix or "Register it on the DistributedDataParallel model that runs the backward pass.")
            )

    def before(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not args and kwargs.get("closure") is None:
            check(opt)

    handles.append(optimizer.register_step_pre_hook(before))
    handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: check(opt)))


def refuse_per_parameter_call(bucket: object, hook: str) -> None:
    """Raise where DDP's Python reducer calls ``hook`` with one parameter's ``(grad, param)``: it
    drops what the hook returns, so the vote would never reach the gradients (each rank would step
    on its own)."""
    if isinstance(bucket, tuple):
        raise RuntimeError(
            f"{hook} was called with one parameter's (grad, param), as DDP's Python reducer calls comm hooks "
            "(torch._dynamo.config.optimize_ddp='python_reducer', the DDP of compiled autograd); that reducer drops "
            "the hook's result, so the vote would not reach the gradients. Build DDP with optimize_ddp left at its "
            "default ('ddp_optimizer') and compiled autograd off, or vote without DDP's hook: "
            "SignumMV/SignMuon(..., vote_in_step=True)"
        )
