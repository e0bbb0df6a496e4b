"""What the rounds save: the model to evaluate or save (the consensus, a collective), and a
checkpoint of the averager itself (the step, the statistics, the settings a resumed run must
share, and with an outer step each fragment's consensus and outer optimizer)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from signmuon.comm_hooks.dist import group_size_rank
from signmuon.optim.checkpoint import agree_to_load

from .members import consensus_state, trained
from .streaming import Fragment

__all__ = ["SavedRounds"]

_FOREIGN = (
    "the rounds' state of another rank is being loaded ({loads}): between rounds each worker's parameters and inner "
    "optimizer state are its own, and DCP (like a file one rank saves) keeps one copy of what every rank saves under "
    "one name, so every rank would resume with one rank's. {remedy}"
)
_PER_RANK = (
    "Save a file per rank with torch.save (model.state_dict(), the optimizer's and averager.state_dict() in "
    "f'rounds.rank{rank}.pt', each rank loading its own), or restart every rank from the workers' average: "
    "averager.consensus_state_dict(model)"
)


class SavedRounds:
    """What :class:`~signmuon.optim.LocalStepAverager` saves and evaluates (a mixin of it)."""

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
        if self.sync_delay and self.layout is None and self._streaming_group is None:
            self._settle()  # its combine runs on the rounds' own group: done before another collective
        params = trained(module)
        if self.outer is not None and [id(p) for p in params] != [id(p) for p in trained(self.module)]:
            raise ValueError(
                "consensus_state_dict(module): its parameters that require grad are not those the consensus "
                "was made of (LocalStepAverager(module=...)'s); pass that module (or the DDP model around it)"
            )
        self._agree_on_call("consensus_state_dict", self.step, params, None)
        self._settle()  # every rank is at this step: every rank issued what is in flight
        wholes = [(part.params, part.consensus.whole()) for part in self.fragments]
        return consensus_state(module, wholes, self.process_group)

    def _settle(self) -> None:
        """Wait for the rounds in flight; each keeps its result until it lands, as it would."""
        for part in self.fragments:
            part.settle(self.stats)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, settings and statistics (what a resumed run needs to continue), and the
        rank that saved it (``"rank"``, in the rounds' group). A fragment's round in flight is
        waited for and saved combined (the same on every rank), so a run resumed from a save
        between its issue and its landing lands it as it would. It is saved as bytes (``"landing"``),
        so the state's names are the same whichever round is in flight: DCP, which loads by
        name into a fresh averager's state, stores them as one object."""
        self._check_landing()  # its distances are saved, as the uninterrupted run has them next
        self._settle()
        return {
            "rank": group_size_rank(self.process_group)[1],
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
            "sync_delay": self.sync_delay,
            "update_alpha": self.update_alpha,
            "consensus": _consensus_states(self.fragments),
            "landing": _landing_bytes(self.fragments),
            "landing_skipped": [p.skipped for p in self.fragments],
        }

    def load_state_dict(self, state: dict[str, Any], *, any_rank: bool = False) -> None:
        """Restore the counters and statistics; settings must match the ones this averager has.

        A state another rank saved is refused on every rank (a collective: every rank loads, or
        every rank raises): between rounds the workers' parameters and inner optimizer states
        differ, and a checkpoint that keeps one rank's copy (DCP's, or one file every rank loads)
        would resume every rank as that one. ``any_rank=True`` loads it whoever saved it, with no
        collective: torchft's healing, which loads a survivor's state on one replica on purpose.
        A state saved before the rank was recorded loads as before."""
        refusal = self._load_refusal(state)
        world_size, _ = group_size_rank(self.process_group)
        if "rank" in state and world_size > 1 and not any_rank:
            agree_to_load(self.process_group, int(state["rank"]), refusal, _PER_RANK, foreign=_FOREIGN)
        if refusal is not None:
            raise ValueError(refusal)
        consensus = state.get("consensus")
        consensus = [consensus] if isinstance(consensus, dict) else consensus or []
        self._step = int(state["step"])
        self.rounds = int(state["rounds"])
        self.mean_distance = float(state["mean_distance"])
        self.max_distance = float(state["max_distance"])
        self.stats.load_state_dict(state["stats"])
        self._settle()  # a round of the run given up: not landed here
        self._landing_check = None  # the last landing's check, of the run given up
        landing = _landing(state.get("landing")) or [None] * len(self.fragments)
        skipped = state.get("landing_skipped") or [False] * len(self.fragments)
        for part, saved_part, combined, skip in zip(self.fragments, consensus, landing, skipped):
            part.consensus.load_state_dict(saved_part)
            device = part.params[0].device
            part.combined = None if combined is None else [t.to(device, copy=True) for t in combined]
            part.skipped = bool(skip)
        if self.outer is not None:
            self._consensus_checked = False
            self._consensus_loaded, self._restored_without_consensus = True, False
        self._settings_checked = True  # the rounds compare them from here

    def _load_refusal(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` cannot load into this averager (None: it can)."""
        saved = {**state, "sync_delay": state.get("sync_delay", 0), "update_alpha": state.get("update_alpha", 0.0)}
        for name in ("period", "warmup_steps", "pull", "push", "distance", "sync_delay", "update_alpha"):
            if saved[name] != getattr(self, name):
                return f"checkpoint has {name}={saved[name]!r}, this averager {getattr(self, name)!r}"
        consensus = state.get("consensus")
        if (consensus is None) != (self.outer is None):
            return "the checkpoint's averager and this one differ in having an outer step"
        consensus = [consensus] if isinstance(consensus, dict) else consensus or []
        if len(consensus) != len(self.fragments):
            return f"the checkpoint's rounds have {len(consensus)} fragment(s), this averager {len(self.fragments)}"
        return None


def _landing_bytes(fragments: list[Fragment]) -> bytes:
    """Each fragment's combined pseudo-gradients waiting to land (None where none), serialized."""
    buffer = io.BytesIO()
    torch.save([None if p.combined is None else [t.detach().cpu() for t in p.combined] for p in fragments], buffer)
    return buffer.getvalue()


def _landing(saved: Any) -> list | None:
    """The landing of a state: bytes, or (saved before) the list itself."""
    if isinstance(saved, (bytes, bytearray)):
        return torch.load(io.BytesIO(saved), weights_only=True)
    return saved


def _consensus_states(fragments: list[Fragment]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The consensus of each fragment (one: as rounds without fragments save it; none: None)."""
    if not fragments:
        return None
    states = [part.consensus.state_dict() for part in fragments]
    return states[0] if len(states) == 1 else states
