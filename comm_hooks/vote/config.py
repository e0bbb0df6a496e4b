"""The vote's settings: one frozen, self-validating object every entry point takes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from .encodings import VOTE_ENCODINGS, ByzantineFault

__all__ = ["VoteConfig", "TIE_MODES", "ZERO_RULES", "ALGORITHMS", "NONFINITE_ACTIONS", "KERNELS"]

TIE_MODES = ("fast", "exact")
ZERO_RULES = ("abstain", "coin")
ALGORITHMS = ("auto", "two_phase", "all_gather")
NONFINITE_ACTIONS = ("skip", "raise")
KERNELS = ("auto", "numba", "triton", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VoteConfig:
    """How a majority vote is computed and sent; taken whole by ``majority_vote``, the DDP hook
    states, ``SignMuon``, ``SignumMV``, ``SignSGDMV``, ``SignCompressedBackend`` and the DeepSpeed
    config's ``"vote"`` section.

    Every field must be equal on every rank (the hooks and optimizers compare them at their
    first call). Every entry point honours every field, except where it says otherwise and
    refuses the value: ``hierarchical`` needs a hook state or an optimizer (they own the node
    layout and, for Signum and SignMuon, the momentum on node means), so ``majority_vote`` and
    ``SignCompressedBackend`` refuse it.
    """

    tie: Literal["fast", "exact"] = "fast"
    """A tie (as many +1 as -1 voters, only possible for an even number of voters): ``"fast"``
    breaks it with an unbiased coin drawn from a hash of (seed, step, parameter, position), the
    same on every rank and after a resume, which keeps the voted result at one bit per entry;
    ``"exact"`` votes 0, the literal ``sign(sum sign)``, which sends the voted zeros too."""
    zeros: Literal["abstain", "coin"] = "abstain"
    """A rank's exact zero (a dead ReLU unit's weights, a momentum row that never moved):
    ``"abstain"`` leaves it out of the vote, and its position travels too (a list, runs or a second
    bit plane); ``"coin"`` votes an unbiased coin instead, drawn from (seed, step, rank,
    parameter, position) like the tie coins, so every entry travels as one bit. A parameter
    that is zero throughout on a rank still abstains there, so an unused parameter stays put.
    With coins, weights no rank moves take random steps of ``lr``."""
    seed: int = 0
    """Base of the tie-break coins (non-negative)."""
    algorithm: Literal["auto", "two_phase", "all_gather"] = "auto"
    """``"two_phase"``: all-to-all of packed shards, shard vote, all-gather of voted shards
    (bandwidth-optimal for any world size); ``"all_gather"``: everyone gets every packed vector
    and votes all of it (one round; the same bytes for two ranks); ``"auto"``: all-gather for
    two ranks, two-phase above."""
    nonfinite: Literal["skip", "raise"] = "skip"
    """When any rank's input holds NaN or Inf: ``"skip"`` gives every rank an all-zero vote
    (counted in ``stats.skipped``); ``"raise"`` raises ``NonFiniteError`` on every rank."""
    kernels: Literal["auto", "numba", "triton", "torch"] = "auto"
    """Pack/vote/unpack kernels: ``"auto"`` takes numba for CPU tensors and Triton for CUDA
    tensors (an ``ImportError`` naming the extra if it is missing); ``"torch"`` takes the
    slower device-agnostic torch operations."""
    hierarchical: bool = False
    """Node-aware vote (the hook states and the sign-vote optimizers; refused by
    ``majority_vote``, which votes each rank's own signs): gradients are averaged in full precision inside each node (fast links),
    and only the signs of the node means are voted between nodes, one bit per entry, each rank
    voting 1/L of the tensor with the ranks of its local index on the other nodes. The voters
    are the N nodes. Flat when there is one node or one rank per node. docs/design.md has the
    schedule and byte formulas."""
    ranks_per_node: int | None = None
    """L, the ranks per node for ``hierarchical``; ``None`` reads torchrun's ``LOCAL_WORLD_SIZE``
    and checks that ranks are numbered node by node."""
    encoding: str = "sign"
    """The encoding the vote sends, a name in ``comm_hooks.vote.encodings.VOTE_ENCODINGS``:
    ``"sign"``, one bit per entry with the tie and zero rules above (docs/design.md, "A new
    encoding", adds one)."""
    fault: ByzantineFault | None = None
    """Testing only: ranks that send wrong signs (see ``ByzantineFault``)."""

    def __post_init__(self) -> None:
        _choice("tie", self.tie, TIE_MODES, "is not a tie mode")
        _choice("zeros", self.zeros, ZERO_RULES, "is not a zero rule")
        _choice("algorithm", self.algorithm, ALGORITHMS, "is unknown")
        _choice("nonfinite", self.nonfinite, NONFINITE_ACTIONS, "is not an action")
        _choice("kernels", self.kernels, KERNELS, "names no kernel family")
        _choice("encoding", self.encoding, tuple(VOTE_ENCODINGS), "names no vote encoding")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative int (it keys the tie-break coins)")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical={self.hierarchical!r} must be a bool")
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(f"ranks_per_node={rpn!r} must be None (from LOCAL_WORLD_SIZE) or an int >= 1")
        if rpn is not None and not self.hierarchical:
            raise ValueError(f"ranks_per_node={rpn} is only used with hierarchical=True")
        if self.fault is not None and not isinstance(self.fault, ByzantineFault):
            raise TypeError(f"fault must be a ByzantineFault or None, got {type(self.fault).__name__}")

    @classmethod
    def of(cls, value: "VoteConfig | None", what: str = "vote") -> "VoteConfig":
        """``value``, or the default config for None; anything else raises TypeError naming ``what``."""
        if value is None:
            return _DEFAULT
        if not isinstance(value, cls):
            raise TypeError(f"{what} must be a VoteConfig, got {type(value).__name__}")
        return value

    @functools.cached_property
    def rail(self) -> "VoteConfig":
        """This config for the vote on one rail of the node-aware schedule: the same fields, flat."""
        return dataclasses.replace(self, hierarchical=False, ranks_per_node=None)

    def settings(self) -> dict:
        """What must agree across ranks, as plain values (for the settings digest)."""
        fault = None if self.fault is None else (self.fault.ranks, self.fault.mode, self.fault.seed)
        return {
            "tie": self.tie,
            "zeros": self.zeros,
            "seed": self.seed,
            "algorithm": self.algorithm,
            "nonfinite": self.nonfinite,
            "kernels": self.kernels,
            "hierarchical": self.hierarchical,
            "ranks_per_node": self.ranks_per_node,
            "fault": fault,
            "encoding": self.encoding,
        }

    @classmethod
    def from_dict(cls, values: dict) -> "VoteConfig":
        """From a config file's section (e.g. DeepSpeed's ``"vote"``); unknown keys are refused."""
        if not isinstance(values, dict):
            raise TypeError(f"the vote section must be a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.name != "fault"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown vote setting(s) {unknown}; valid: {sorted(known)}")
        return cls(**values)


def _choice(name: str, value, choices: tuple[str, ...], why: str) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} {why}; use one of {choices}")


_DEFAULT = VoteConfig()
