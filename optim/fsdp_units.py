"""The FSDP vote unit by unit, during backward: where FSDP2's hooks meet the exchange.

FSDP2 reduce-scatters each unit (each ``fully_shard``-ed module) as backward leaves it, then
calls the unit's all-reduce hook (``FSDPModule.set_all_reduce_hook``; on a 1-D mesh the
reduction between replicas is the hook's to do) and, once each parameter's sharded gradient is
in ``.grad``, that parameter's post-accumulate-grad hooks. The unit is complete when the
gradients of every parameter FSDP reduced have arrived (their padded shards add up to the
all-reduce hook's buffer): then the unit is voted from ``.grad``, exactly what ``step()`` would
read, so the result is the step-time vote's bit for bit.

The votes run on one worker thread, in the order the units closed (the same on every rank), so
backward goes on computing the next units while a unit's signs travel: the vote reads the host
(its NaN flags and headers) and waits on its collectives, which on the autograd thread would
stall backward. Its collectives use groups of their own (FSDP2's reduce-scatter runs on the
node's group meanwhile). As DDP's reducer does, backward ends only when every vote has: a
callback at the end of backward joins the worker (on CUDA, the current stream then waits for
the worker's stream), so nothing can touch the gradients while a vote reads them.

Gradient accumulation needs nothing more: under ``set_requires_gradient_sync(False)`` FSDP2
does not reduce, so the hooks run on the last micro-batch only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.fsdp import FSDPModule

from signmuon.comm_hooks import NonFiniteError, VoteMismatchError
from signmuon.comm_hooks.shard_vote import ShardSpec

from .params import local_tensor

__all__ = ["UnitVotes", "fsdp_units"]


def _managed(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters a unit reduces: its own and those of submodules outside nested units."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, FSDPModule):
            params += _managed(child)
    return params


def fsdp_units(model: torch.nn.Module) -> list[tuple[FSDPModule, list[torch.Tensor]]]:
    """Every ``fully_shard``-ed module of ``model`` with the trainable parameters it reduces."""
    units = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            seen: dict[int, torch.Tensor] = {}
            for p in _managed(module):
                if p.requires_grad:
                    seen.setdefault(id(p), p)
            units.append((module, list(seen.values())))
    return units


class UnitVotes:
    """What each unit's all-reduce hook and its parameters' post-accumulate-grad hooks share.

    Args:
        units: each unit's parameters, in the optimizer's order.
        ranks_per_node: the ranks a unit is sharded over.
        vote: votes unit i's parameters from the given gradients (None: no gradient), on the
            worker thread: ``vote(i, params, grads)``.
        device: where the gradients live.
        settle: at the end of each backward that voted, raises a mismatch any rank deferred, on every rank.
    """

    def __init__(
        self,
        units: list[list[torch.Tensor]],
        ranks_per_node: int,
        vote: Callable[[int, list[torch.Tensor], list[torch.Tensor | None]], None],
        device: torch.device,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        self.units, self.vote, self.device, self.settle = units, vote, device, settle
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="signmuon-fsdp-vote")
        self.running: list[Future] = []
        self.failed = False
        """Whether a vote of this backward raised an error every rank raises alike (a mismatch, a
        NaN under ``nonfinite="raise"``): the later votes then issue nothing, as on every other rank."""
        self.stream = None  # the worker's CUDA stream, made on first use
        self.unit_of = {p: i for i, params in enumerate(units) for p in params}
        # One rank's shard in FSDP2's reduce-scatter output: dimension 0 padded to a multiple of the ranks.
        specs = {p: ShardSpec(tuple(p.shape), key=0) for p in self.unit_of}
        self.numel = {p: spec.rows_per_rank(ranks_per_node) * spec.row_numel for p, spec in specs.items()}
        self.open: int | None = None
        """The unit FSDP is reducing now; None between units."""
        self.expected = self.arrived = 0
        self.voted: set[int] = set()
        """Units voted since the last ``step()``."""

    def register(self, modules: list[FSDPModule]) -> None:
        """Install the hooks on ``modules`` (one per unit) and their parameters."""
        for index, module in enumerate(modules):
            module.set_all_reduce_hook(self._reduced_hook(index))
        for p in self.unit_of:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _reduced_hook(self, unit: int) -> Callable[[torch.Tensor], None]:
        def reduced(reduce_output: torch.Tensor) -> None:
            self.reduced(unit, reduce_output.numel())

        return reduced

    def reduced(self, unit: int, numel: int) -> None:
        """Unit ``unit``'s reduce-scatter output (``numel`` entries) is ready."""
        if self.open is not None:
            raise RuntimeError(
                f"FSDP unit {unit} was reduced before unit {self.open} had all its gradients: units reduced together "
                "(fully_shard of a list of modules) cannot be voted during backward; pass during_backward=False"
            )
        if unit in self.voted:
            raise RuntimeError(
                "a second backward reduced gradients before optimizer.step(): the vote advances the momentum once per "
                "step. For gradient accumulation call model.set_requires_gradient_sync(False) on every micro-batch but "
                "the last"
            )
        self.open, self.expected, self.arrived = unit, numel, 0
        if numel == 0:
            self._close()

    def _accumulated(self, param: torch.Tensor) -> None:
        unit = self.unit_of.get(param)
        if unit is None or unit != self.open:
            raise RuntimeError(
                f"a gradient of shape {tuple(param.shape)} arrived outside its FSDP unit's reduction (unit {unit}, "
                f"reducing {self.open}): the vote during backward needs FSDP2's reduce-scatter to set it"
            )
        self.arrived += self.numel[param]
        if self.arrived > self.expected:
            raise RuntimeError(
                f"FSDP unit {unit} delivered {self.arrived} gradient entries for a buffer of {self.expected}: its "
                "parameters are not the ones this vote expects (was fully_shard applied after register_fsdp_vote?)"
            )
        if self.arrived == self.expected:
            self._close()

    def _close(self) -> None:
        unit, self.open = self.open, None
        self.voted.add(unit)
        params = self.units[unit]
        grads = [None if p.grad is None else local_tensor(p.grad) for p in params]
        if not self.running:  # the first vote of this backward: join them all at its end
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        ready = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        self.running.append(self.worker.submit(self._vote, unit, params, grads, ready))

    def _vote(self, unit: int, params: list[torch.Tensor], grads: list[torch.Tensor | None], ready) -> object:
        if self.failed:
            return None
        try:
            with torch.no_grad():  # grad mode is per thread
                if ready is None:
                    self.vote(unit, params, grads)
                    return None
                with torch.cuda.device(self.device):
                    if self.stream is None:
                        self.stream = torch.cuda.Stream(self.device)
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        self.vote(unit, params, grads)
                        return self.stream.record_event()
        except (VoteMismatchError, NonFiniteError):
            self.failed = True
            raise

    def finish(self) -> None:
        """At the end of backward (and at ``step()``): wait for every unit's vote (raising the
        first error, after all ended) and check that no unit was left half reduced."""
        running, self.running = self.running, []
        errors = [f.exception() for f in running]
        self.failed = False
        error = next((e for e in errors if e is not None), None)
        if running:  # the worker is idle now: its node group is free for the one collective of settle
            try:
                self.settle()
            except VoteMismatchError as mismatch:
                error = error or mismatch
        if error is not None:
            raise error
        for f in running:
            if f.result() is not None:
                torch.cuda.current_stream(self.device).wait_event(f.result())
        if self.open is not None:
            unit, self.open = self.open, None
            raise RuntimeError(
                f"FSDP unit {unit} was reduced but only {self.arrived} of its {self.expected} gradient entries arrived "
                "before step()"
            )

    def stepped(self) -> None:
        self.voted.clear()
