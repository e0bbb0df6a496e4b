"""torchft: rounds that go on when a replica group is lost, and take it back when it returns.

torchft's ``Manager`` keeps a quorum of replica groups through a lighthouse and reconfigures
one process group over the replicas of each quorum. :class:`FaultTolerantRounds` runs a
:class:`~signmuon.optim.LocalStepAverager`'s rounds (DiLoCo, DPPF, one-bit rounds) over that group:

- a round that fails (a replica died before or during it) is rolled back on every survivor:
  parameters and consensus as before the round. The survivors keep their local steps, and the
  next round, over the new quorum, carries them;
- a replica that comes back (the same ``replica_id``, started again) is healed by the Manager at
  the next quorum, which begins right after a round: it loads a survivor's parameters, its inner
  optimizer and the averager (the consensus, the outer optimizer, the step), so it rejoins from
  the consensus, at the survivors' step.

Inside a replica group each step is the user's own. With FSDP2 over the group's ranks, torchft's
group of local rank l joins the ranks holding shard l in every replica group, so each rank's
round carries its shard only (the consensus and outer state are shards, and a healing rank
loads its shard from the same local rank of a survivor). With DDP inside the group every rank
would carry the whole model on its own group: correct, but L times the bytes. Use::

    from torchft import Manager, ProcessGroupGloo
    from signmuon.integrations.torchft import FaultTolerantRounds
    from signmuon.optim import LocalStepAverager, OuterStep

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))   # how long a dead peer can stall a round
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=None, state_dict=None,
                      use_async_quorum=False, replica_id=..., lighthouse_addr=..., ...)
    averager = LocalStepAverager(period=8, outer=OuterStep.diloco(), module=model, process_group=pg)
    rounds = FaultTolerantRounds(manager, averager, optimizer)   # joins (or heals) now
    while rounds.steps_done < total_steps:
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        rounds.step()

``use_async_quorum=False`` is required: healing must finish before the replica's next local
step, so that it trains from the consensus and counts in the next round. To roll a round back,
each round first copies the parameters and the averager's state (consensus, outer optimizer,
feedback buffers): about two models' worth of memory while it runs. A rolled-back round's bytes
leave ``averager.stats`` with it.
Needs ``pip install 'signmuon[torchft]'``.
"""

from __future__ import annotations

try:
    import torchft
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("signmuon.integrations.torchft needs torchft: pip install 'signmuon[torchft]'") from error

import copy
from typing import Any

import torch

from signmuon.comm_hooks.dist import NonFiniteError, SettingsMismatchError, VoteMismatchError
from signmuon.optim import LocalStepAverager

__all__ = ["FaultTolerantRounds"]

STATE_KEY = "signmuon_rounds"
# Raised alike on every rank by the round's own checks: the run is wrong, not a replica lost.
_RUN_ERRORS = (NonFiniteError, SettingsMismatchError, VoteMismatchError)


class FaultTolerantRounds:
    """A :class:`~signmuon.optim.LocalStepAverager`'s rounds under a torchft ``Manager``.

    Args:
        manager: torchft's ``Manager``, built with ``use_async_quorum=False`` over the process
            group the averager was built with.
        averager: the rounds, with an outer step (``module=`` given).
        optimizer: the inner optimizer; its state travels to a replica that heals.

    Statistics: ``rounds_committed``, ``rounds_failed`` (rolled back), ``heals`` (times this
    replica loaded a survivor's state), ``last_error`` (what failed the last failed round).
    """

    def __init__(self, manager: Any, averager: LocalStepAverager, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(averager, LocalStepAverager) or averager.outer is None:
            raise ValueError(
                "FaultTolerantRounds needs a LocalStepAverager with an outer step (outer=OuterStep(...), module=model): "
                "a replica rejoins from its consensus"
            )
        if len(averager.fragments) > 1 or averager.sync_delay:
            raise ValueError(
                "FaultTolerantRounds rolls a whole round back when a replica is lost; streaming rounds (fragments=, "
                "sync_delay=) keep a fragment's round in flight across steps, which it cannot roll back: use "
                "fragments=1 and sync_delay=0 here, or torchft's own streaming DiLoCo (torchft.local_sgd.DiLoCo)"
            )
        if averager.layout is not None:
            raise ValueError("FaultTolerantRounds runs flat rounds between replica groups; leave layout= unset")
        if averager.outer.pseudo_gradient == "scaled_sign":
            raise ValueError(
                "pseudo_gradient='scaled_sign' keeps error buffers sized by the number of replicas, which changes "
                "when one is lost; use 'mean', 'sign_vote' or 'sign_vote_ef'"
            )
        if not isinstance(manager, torchft.Manager):
            raise TypeError(f"FaultTolerantRounds needs a torchft.Manager, got {type(manager).__name__}")
        self.manager, self.averager, self.optimizer = manager, averager, optimizer
        self.module = averager.module
        self.rounds_committed = 0
        self.rounds_failed = 0
        self.heals = 0
        self.last_error: BaseException | None = None
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)
        manager.start_quorum()

    @property
    def steps_done(self) -> int:
        """Local steps this replica's run has taken (a healed replica takes the survivors' count)."""
        return self.averager.step

    def step(self) -> bool | None:
        """Call after each inner ``optimizer.step()``. Runs the round when one is due; returns
        whether it was committed (None when no round was due)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not self.averager.is_round():
            self.averager.average_parameters(params)
            return None
        before = self._snapshot(params)
        try:
            self.averager.average_parameters(params)
        except _RUN_ERRORS:
            raise
        except Exception as error:  # a lost peer: the collective fails or times out
            self.manager.report_error(error)
            self.last_error = error
        committed = self.manager.should_commit()
        if committed:
            self.rounds_committed += 1
        else:
            self._restore(params, before)
            self.rounds_failed += 1
        self.manager.start_quorum()  # the next quorum: drops the lost, heals the returned
        return committed

    def _snapshot(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return [p.detach().clone() for p in params], copy.deepcopy(self.averager.state_dict())

    @torch.no_grad()
    def _restore(self, params: list[torch.Tensor], before: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
        saved_params, saved_averager = before
        for p, saved in zip(params, saved_params):
            p.copy_(saved)
        self.averager.load_state_dict(saved_averager, any_rank=True)  # its own, with no collective: a peer is lost
        self.averager.step = saved_averager["step"] + 1  # the local step stands; only the round is undone

    def state_dict(self) -> dict[str, Any]:
        """What a healing replica loads: parameters, inner optimizer, averager (copies, since the
        Manager serves them while this replica trains on)."""
        return copy.deepcopy(
            {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "averager": self.averager.state_dict(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.averager.load_state_dict(state["averager"], any_rank=True)  # a survivor's, on purpose
        self.heals += 1
