"""The engine of local-step training: every ``period`` steps after ``warmup_steps``, a round
moves each worker toward the workers' average, or, with an outer step, toward a consensus
stepped with their pseudo-gradients (:mod:`~signmuon.optim.rounds.outer_step`); DPPF's pull and
push (:mod:`~signmuon.optim.rounds.dppf`) act around that target."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from signmuon.comm_hooks import NodeLayout
from signmuon.comm_hooks.dist import (
    CommStats,
    NonFiniteError,
    check_same_settings,
    flatten,
    mean_all_reduce,
    settings_digest,
    unflatten_into,
)

from ..params import local_tensor
from .aliases import refuse_shared_memory
from .consensus import Consensus, agree_on_call, check_shards, round_flags
from .dppf import pull_push, worker_distances
from .members import all_params, by_dtype_and_device, consensus_state, first_names, in_module_order, trained
from .outer_step import OuterStep
from .rails import mean_between_nodes
from .settings import DISTANCES, averager_settings, check_arguments, check_int, check_layout

__all__ = ["DISTANCES", "DPPFAverager", "LocalStepAverager"]


class LocalStepAverager(ModelAverager):
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

    Sharded models (FSDP2 over each node, see the module's docstring): pass
    ``process_group=mesh["node"].get_group()``; the rounds run on this rank's shards, and
    ``mean_distance`` / ``max_distance`` are then this shard's.

    Each round starts with small all-gathers that make it safe against what differs between
    ranks (:func:`~signmuon.optim.rounds.consensus.round_flags`): a mismatch raises on every rank,
    and so does a rank that reaches a round or :meth:`consensus_state_dict` after another number
    of optimizer steps than the others. Tied weights (one Parameter under several names) take
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
    ) -> None:
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        check_arguments(pull, push, eps, distance, nonfinite, outer, module)
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
        self.consensus = None
        if module is not None:
            check_shards(module, self.process_group, self.push, self.layout)
            refuse_shared_memory(trained(module), first_names(module))
        if outer is not None:
            params = [local_tensor(p) for p in module.parameters() if p.requires_grad]
            self.consensus = Consensus(by_dtype_and_device(params), outer, self.process_group, self.layout)
            self._consensus_checked = False  # compared at the first round after construction or a load

    @property
    def step(self) -> int:
        """Optimizer steps this averager has seen (``PostLocalSGDOptimizer`` saves and sets it)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # Set from outside past the warm-up (PostLocalSGDOptimizer.load_state_dict) on an averager
        # whose consensus was built here: that consensus is not the restored step's.
        value = int(value)
        if getattr(self, "consensus", None) is not None and not self._consensus_loaded and value != self._step:
            self._restored_without_consensus = value >= self.warmup_steps
        self._step = value

    def is_round(self, step: int | None = None) -> bool:
        """Whether ``step`` (default: the next one) averages."""
        step = self.step if step is None else step
        if step < self.warmup_steps:
            return False
        if self.outer is not None:  # after every `period` local steps
            return (step - self.warmup_steps + 1) % self.period == 0
        return (step - self.warmup_steps) % self.period == 0  # torch's: right after the warm-up, then every period

    def average_parameters(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Called after every optimizer step; runs a pull-push round when one is due.

        As torch's averagers do, only parameters that have a gradient take part, here those
        with a gradient on any rank (so every rank averages the same set).
        """
        self._check_settings()
        params = all_params(params)
        if self.consensus is not None:  # every call: a wrong parameter list fails at once, not at a round
            params = in_module_order(self.module, params)
            groups = by_dtype_and_device(local_tensor(p) for p in params)
            if self.step == self.warmup_steps - 1:  # the workers are equal at the end of the warm-up
                self.consensus.reset([flatten(tensors) for tensors in groups])
        if self.is_round():
            refuse_shared_memory(params, first_names(self.module) if self.module is not None else None)
            agreed = self._agreed_params(params)
            if agreed is not None:
                self._round(params if self.consensus is not None else agreed)
        self._step += 1

    def _check_settings(self) -> None:
        """At a fresh averager's first collective: the same settings on every rank."""
        if not self._settings_checked:
            check_same_settings(averager_settings(self), self.process_group, what="LocalStepAverager settings")
            self._settings_checked = True

    def _agreed_params(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The parameters every rank averages this round, or None when the round is skipped."""
        if dist._rank_not_in_group(self.process_group):
            return None
        unchecked = self.consensus is not None and not self._consensus_checked
        used, bad_ranks, check_consensus = round_flags(
            params,
            self._buffers(),
            self.process_group,
            self.step + 1,  # the steps taken, this one included
            self.stats,
            settings=settings_digest(averager_settings(self)),
            unchecked=unchecked,
            restored_without_consensus=self._restored_without_consensus,
        )
        if check_consensus:  # some rank is new to this consensus (first round, or loaded): all compare
            self.consensus.check_same_start(self.stats)
            self._consensus_checked = True
        if bad_ranks:
            self.stats.skipped += 1
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"NaN or Inf in the parameters of rank(s) {bad_ranks} at a round (step {self.step})"
                )
            return None
        return used

    def _buffers(self) -> list[torch.Tensor]:
        if not (self.average_buffers and self.module is not None):
            return []
        return [b for b in self.module.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def _round(self, params: list[torch.Tensor]) -> None:
        group = self.process_group
        if dist._rank_not_in_group(group):
            return
        params = [local_tensor(p) for p in params]  # FSDP2: this rank's shards
        self.stats.calls += 1
        distances = []
        groups = by_dtype_and_device(params)
        flats = [flatten(tensors) for tensors in groups]  # [n] this worker's x, per group
        if self.consensus is not None:
            targets = self.consensus.advance(flats, self.stats)
        else:  # x_bar (torch's order: divide, then sum)
            targets = [mean_between_nodes(flat.clone(), group, self.layout, self.stats) for flat in flats]
        per_tensor = self.distance == "tensor"
        for tensors, flat, target in zip(groups, flats, targets):
            distances += pull_push(tensors, flat, target, self.pull, self.push, self.eps, per_tensor=per_tensor)
        if self.average_buffers and self.module is not None:
            self._average_buffers()
        self.mean_distance, self.max_distance = worker_distances(distances, self.process_group, self.track_distances)
        self.rounds += 1

    def _average_buffers(self) -> None:
        for tensors in by_dtype_and_device(self._buffers()):
            unflatten_into(mean_all_reduce(flatten(tensors), self.process_group, self.stats), tensors)

    # -- the consensus model ---------------------------------------------------------------

    @torch.no_grad()
    def consensus_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every floating-point tensor replaced by its mean over the
        workers (x_bar), and with an outer step the parameters by the consensus: the model to
        evaluate or save. Every name of a tied tensor carries its value (the names share one
        tensor, as in ``module.state_dict()``). A collective: call it on every rank after as
        many optimizer steps (else ``VoteMismatchError`` on every rank, naming each rank's
        steps). The workers' own parameters are left untouched, and ``stats`` does not count
        this (evaluation traffic, not training)."""
        self._check_settings()
        params = trained(module)
        if self.consensus is not None and [id(p) for p in params] != [id(p) for p in trained(self.module)]:
            raise ValueError(
                "consensus_state_dict(module): its parameters that require grad are not those the consensus "
                "was made of (LocalStepAverager(module=...)'s); pass that module (or the DDP model around it)"
            )
        agree_on_call(
            "consensus_state_dict",
            self.step,
            params,
            self.process_group,
            None,
            settings=settings_digest(averager_settings(self)),
            restored_without_consensus=self._restored_without_consensus,
        )
        wholes = self.consensus.whole() if self.consensus is not None else []
        return consensus_state(module, params, wholes, self.process_group)

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, settings and statistics (what a resumed run needs to continue)."""
        return {
            "step": self.step,
            "rounds": self.rounds,
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "pull": self.pull,
            "push": self.push,
            "eps": self.eps,
            "distance": self.distance,
            "mean_distance": self.mean_distance,
            "max_distance": self.max_distance,
            "stats": self.stats.state_dict(),
            "consensus": None if self.consensus is None else self.consensus.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters and statistics; settings must match the ones this averager has."""
        for name in ("period", "warmup_steps", "pull", "push", "distance"):
            if state[name] != getattr(self, name):
                raise ValueError(f"checkpoint has {name}={state[name]!r}, this averager {getattr(self, name)!r}")
        self._step = int(state["step"])
        self.rounds = int(state["rounds"])
        self.mean_distance = float(state["mean_distance"])
        self.max_distance = float(state["max_distance"])
        self.stats.load_state_dict(state["stats"])
        if (state.get("consensus") is None) != (self.consensus is None):
            raise ValueError("the checkpoint's averager and this one differ in having an outer step")
        if self.consensus is not None:
            self.consensus.load_state_dict(state["consensus"])
            self._consensus_checked = False
            self._consensus_loaded, self._restored_without_consensus = True, False
        self._settings_checked = True  # the rounds compare them from here


class DPPFAverager(LocalStepAverager):
    """The name :class:`LocalStepAverager` had until signmuon 0.1; it goes in 0.3."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "DPPFAverager is now LocalStepAverager (signmuon.optim.LocalStepAverager), the same class; "
            "the old name is removed in signmuon 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
