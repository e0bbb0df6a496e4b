"""The engine of local-step training: every ``period`` steps after ``warmup_steps``, a round
moves each worker toward the workers' average, or, with an outer step, toward a consensus
stepped with their pseudo-gradients (:mod:`~signmuon.optim.rounds.outer_step`); DPPF's pull and
push (:mod:`~signmuon.optim.rounds.dppf`) act around that target."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from signmuon.comm_hooks import NodeLayout
from signmuon.comm_hooks.dist import (
    CommStats,
    flatten,
    mean_all_reduce,
    settings_digest,
    unflatten_into,
)

from .agreement import CALLS, AgreedRounds, CallAgreement
from .aliases import refuse_shared_memory
from .checkpoints import SavedRounds
from .consensus import Consensus, check_shards
from .dppf import pull_push, worker_distances
from .members import all_params, by_dtype_and_device, first_names, in_module_order, local_groups, trained
from .outer_step import OuterStep
from .rails import mean_between_nodes
from .settings import DISTANCES, averager_settings, check_arguments, check_int, check_layout
from .streaming import (
    Fragment,
    check_fragments,
    check_streaming,
    fragment_due,
    fragment_members,
    streaming_group,
)

__all__ = ["DISTANCES", "LocalStepAverager"]


class LocalStepAverager(AgreedRounds, SavedRounds, ModelAverager):
    """The averager of local-step training (local SGD, DPPF, DiLoCo, MuLoCo, one-bit and
    node-aware rounds); plugs into ``PostLocalSGDOptimizer`` like ``PeriodicModelAverager``.

    Args:
        period: local steps between averaging rounds (>= 1).
        warmup_steps: steps before the first round (during which DDP averages gradients).
        pull: alpha in [0, 1], the fraction of the way to the average each round.
        push: lambda >= 0, the length of the step away from the average.
        eps: floor of the distance the push is normalised by (so a worker at the average
            is not pushed by a huge or NaN amount).
        process_group: workers to average over (None = WORLD).
        average_buffers: average ``module``'s floating-point buffers (BatchNorm statistics)
            at each round, as a plain mean. (DDP by default copies rank 0's buffers to every
            rank at each forward; buffers differ between rounds only where that is off.)
        module: the module whose buffers to average (its parameters come via ``params``).
        distance: ``"model"`` measures r_i over all averaged parameters together (the paper's
            choice: one push of length ``push`` per worker); ``"tensor"`` measures and pushes
            each tensor on its own (each moves ``push`` away from its own average).
        track_distances: gather every worker's r_i each round (a tiny all-gather) for the
            statistics ``mean_distance`` / ``max_distance``; off leaves them at this rank's r_i.
            A streamed round's (``sync_delay > 0``) ride in its landing's check, which is
            issued as it lands and read at the averager's next collective (the next take,
            ``consensus_state_dict`` or ``state_dict``), so that a landing waits for no other
            rank: the statistics are the previous landing's until then.
        nonfinite: what a round does when some rank's parameters (or averaged buffers) hold NaN
            or Inf: ``"skip"`` skips the round on every rank (counted in ``stats.skipped``), so no
            replica averages the bad one in; ``"raise"`` raises ``NonFiniteError`` on every rank.
        outer: the outer step (:class:`OuterStep`): a round combines the workers' pseudo-gradients
            against a consensus and steps it; pull and push act around the new consensus. The
            consensus starts as ``module``'s parameters (required; build the averager after DDP,
            which makes them equal) and again at the end of the warm-up; a round comes after
            every ``period`` local steps (DiLoCo's schedule; without ``outer``, torch's: right
            after the warm-up, then every ``period``). Every parameter of ``module`` that
            requires grad takes part, and ``average_parameters`` must get exactly those, in any
            order or grouping (Muon's parameter groups, for MuLoCo).
        layout: node-aware rounds (:func:`signmuon.comm_hooks.node_layout`, at least two nodes):
            :func:`local_sgd` all-reduces gradients inside each node every step, and a round
            sends only each local rank's 1/L slice, over its rail.
        fragments: streaming rounds (:mod:`~signmuon.optim.rounds.streaming`, torchft's
            streaming DiLoCo; needs ``outer``): a count F (``module``'s trained parameters cut in
            its order into F runs balanced by bytes) or a list of fragments, each a module or a
            list of modules. One fragment's round every ``period / F`` steps, round-robin.
        sync_delay: τ, the local steps between a fragment's pseudo-gradient being taken (and its
            collective issued) and its round landing; ``< period / F``.
        update_alpha: α, the share of its local weights each worker keeps when a round lands
            (torchft's ``fragment_update_alpha``): the step toward the consensus is ``pull·(1-α)``.

    Sharded models (FSDP2 over each node, see the module's docstring): pass
    ``process_group=mesh["node"].get_group()``; the rounds run on this rank's shards, and
    ``mean_distance`` / ``max_distance`` are then this shard's.

    Each round starts with a small all-gather (two without an outer step, whose rounds gather
    who has a gradient) that makes it safe against what differs between ranks
    (:mod:`~signmuon.optim.rounds.agreement`): a mismatch raises on every rank, and so does a
    rank that reaches a round or :meth:`consensus_state_dict` after another number of optimizer
    steps than the others (a streamed round's landing: at that rank's next collective of the
    averager). Tied weights (one Parameter under several names) take
    part once; two Parameters over the same memory are refused.

    Statistics (read them off the object): ``rounds``, ``mean_distance``, ``max_distance``
    (worker distance to x_bar at the last round, before the update: the measured valley
    width), ``stats`` (bytes all-reduced, a :class:`CommStats`; ``stats.skipped``: rounds skipped).
    """

    _step = 0
    _consensus_loaded = False  # the consensus came from a state dict, with the step it was saved at
    _restored_without_consensus = False

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        *,
        pull: float = 0.5,
        push: float = 0.0,
        eps: float = 1e-8,
        process_group: dist.ProcessGroup | None = None,
        average_buffers: bool = True,
        module: nn.Module | None = None,
        distance: str = "model",
        track_distances: bool = True,
        nonfinite: str = "skip",
        outer: OuterStep | None = None,
        layout: NodeLayout | None = None,
        fragments: int | Sequence[Any] = 1,
        sync_delay: int = 0,
        update_alpha: float = 0.0,
    ) -> None:
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        check_arguments(pull, push, eps, distance, nonfinite, outer, module)
        self.sync_delay, self.update_alpha = check_streaming(fragments, sync_delay, update_alpha, outer)
        members = fragment_members(module, fragments) if outer is not None else []
        if members:
            check_fragments(len(members), self.period, self.sync_delay, push)
        super().__init__(process_group)  # sets self.process_group (WORLD if None) and self.step = 0
        self.pull = float(pull)
        self.push = float(push)
        self.eps = float(eps)
        self.average_buffers = bool(average_buffers)
        self.module = module
        self.distance = distance
        self.track_distances = bool(track_distances)
        self.nonfinite = nonfinite
        self.rounds = 0
        self.mean_distance = float("nan")
        self.max_distance = float("nan")
        self.stats = CommStats()
        # Settings are compared at a fresh averager's first call (a mismatch fails before any
        # training) and at every round (so a replica that rejoins with a loaded state is too).
        self._settings_checked = False
        self.layout = check_layout(layout, self.process_group)
        self.outer = outer
        self.fragments: list[Fragment] = []  # with an outer step: one per fragment (one without streaming)
        if module is not None:
            check_shards(module, self.process_group, self.push, self.layout)
            refuse_shared_memory(trained(module), first_names(module))
        if outer is not None:
            for params in members:
                consensus = Consensus(local_groups(params), outer, self.process_group, self.layout)
                self.fragments.append(Fragment(params, consensus))
            self._consensus_checked = False  # compared at the first round after construction or a load
        self._streaming_group = streaming_group(self.process_group, self.layout, self.sync_delay)

    @property
    def consensus(self) -> Consensus | None:
        """The consensus of rounds with an outer step (None without one); with fragments each
        has its own, ``fragments[f].consensus``."""
        if len(self.fragments) > 1:
            raise ValueError(
                f"this averager's rounds have {len(self.fragments)} fragments, each with its own consensus: "
                "read averager.fragments[f].consensus"
            )
        return self.fragments[0].consensus if self.fragments else None

    @property
    def step(self) -> int:
        """Optimizer steps this averager has seen (``PostLocalSGDOptimizer`` saves and sets it)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # Set from outside past the warm-up (PostLocalSGDOptimizer.load_state_dict) on an averager
        # whose consensus was built here: that consensus is not the restored step's.
        value = int(value)
        if getattr(self, "outer", None) is not None and not self._consensus_loaded and value != self._step:
            self._restored_without_consensus = value >= self.warmup_steps
        self._step = value

    def is_round(self, step: int | None = None) -> bool:
        """Whether ``step`` (default: the next one) averages."""
        step = self.step if step is None else step
        if step < self.warmup_steps:
            return False
        if self.outer is not None:  # a fragment's round lands after every period / F local steps
            return (step - self.warmup_steps + 1) % (self.period // len(self.fragments)) == 0
        return (step - self.warmup_steps) % self.period == 0  # torch's: right after the warm-up, then every period

    def average_parameters(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Called after every optimizer step; runs a pull-push round when one is due.

        As torch's averagers do, only parameters that have a gradient take part, here those
        with a gradient on any rank (so every rank averages the same set).
        """
        self._check_settings()
        params = all_params(params)
        if self.outer is not None:  # every call: a wrong parameter list fails at once, not at a round
            params = in_module_order(self.module, params)
            if self.step == self.warmup_steps - 1:  # the workers are equal at the end of the warm-up
                for part in self.fragments:
                    part.consensus.reset([flatten(tensors) for tensors in local_groups(part.params)])
            self._outer_rounds(params)
        elif self.is_round():
            refuse_shared_memory(params, first_names(self.module) if self.module is not None else None)
            agreed = self._agreed_params(params)
            if agreed is not None:
                self._round(agreed)
        self._step += 1

    def _outer_rounds(self, params: list[torch.Tensor]) -> None:
        """Take (pseudo-gradient and collective) and land (outer step, pull) the fragments' rounds due now."""
        k = self.step - self.warmup_steps + 1  # local steps since the warm-up, this one included
        self.stats.round_steps_hidden += sum(part.in_flight is not None for part in self.fragments)
        taken, lands = fragment_due(k, self.period, len(self.fragments), self.sync_delay) if k > 0 else (None, None)
        if taken is not None:
            refuse_shared_memory(params, first_names(self.module))
            self._take(self.fragments[taken])
        if lands is not None:
            self._land(self.fragments[lands])

    def _buffers(self) -> list[torch.Tensor]:
        if not (self.average_buffers and self.module is not None):
            return []
        return [b for b in self.module.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def _round(self, params: list[torch.Tensor]) -> None:
        """A round without an outer step: every worker around the workers' average."""
        group = self.process_group
        if dist._rank_not_in_group(group):
            return
        self.stats.calls += 1
        groups = local_groups(params)
        flats = [flatten(tensors) for tensors in groups]  # [n] this worker's x, per group
        # x_bar (torch's order: divide, then sum)
        targets = [mean_between_nodes(flat.clone(), group, self.layout, self.stats) for flat in flats]
        self._pull_push(groups, flats, targets, self.pull)

    @torch.no_grad()
    def _take(self, part: Fragment) -> None:
        """A fragment's round, taken: its pseudo-gradient, combined over the workers."""
        if self._agreed_params(part.params) is None:
            part.skipped = True
            return
        self.stats.calls += 1
        flats = [flatten(tensors) for tensors in local_groups(part.params)]
        part.take(flats, self.stats, self._streaming_group, streamed=self.sync_delay > 0)

    @torch.no_grad()
    def _land(self, part: Fragment) -> None:
        """A fragment's round, landed: the outer step, then each worker toward the new consensus."""
        in_group = not dist._rank_not_in_group(self.process_group)
        issues = part.in_flight is not None and part.in_flight.issues_at_wait()
        if self.sync_delay and in_group and (issues or self._buffers()):
            # taken τ steps ago: the landing's own collectives (a second phase, the buffers' mean) are checked first
            self._agree_on_call(CALLS[0], self.step + 1, part.params, self.stats)
        part.settle(self.stats)
        if part.skipped or not in_group:
            part.skipped = False
            return
        if part.combined is None:
            raise ValueError(
                f"a fragment's round lands at step {self.step} but was never taken on this rank: the averager was "
                "restored between its sync_delay steps without the state it saved (load LocalStepAverager.state_dict())"
            )
        combined, part.combined = part.combined, None
        targets = part.consensus.land(combined, self.stats)
        groups = local_groups(part.params)
        pull = self.pull * (1.0 - self.update_alpha)
        distance = self._pull_push(
            groups, [flatten(tensors) for tensors in groups], targets, pull, gather=not self.sync_delay
        )
        if self.sync_delay:  # checked, with every worker's distance, at the averager's next collective
            self._landing_check = CallAgreement(
                CALLS[0],
                self.step + 1,
                part.params,
                self.process_group,
                self.stats,
                settings=settings_digest(averager_settings(self)),
                distance=distance,
            )

    def _pull_push(
        self,
        groups: list[list[torch.Tensor]],
        flats: list[torch.Tensor],
        targets: list[torch.Tensor],
        pull: float,
        *,
        gather: bool = True,
    ) -> float:
        """Every worker toward ``targets`` (and DPPF's push); returns this worker's distance, and
        sets the statistics: the workers' distances, gathered where ``gather``, else this one's."""
        distances = []
        per_tensor = self.distance == "tensor"
        for tensors, flat, target in zip(groups, flats, targets):
            distances += pull_push(tensors, flat, target, pull, self.push, self.eps, per_tensor=per_tensor)
        if self.average_buffers and self.module is not None:
            self._average_buffers()
        self.mean_distance, self.max_distance = worker_distances(
            distances, self.process_group, self.track_distances and gather
        )
        self.rounds += 1
        return math.sqrt(sum(r * r for r in distances))

    def _average_buffers(self) -> None:
        for tensors in by_dtype_and_device(self._buffers()):
            unflatten_into(mean_all_reduce(flatten(tensors), self.process_group, self.stats), tensors)
