"""The outer step of rounds (DiLoCo, Douillard et al. 2023): the workers share a consensus
x_prev, and a round steps it with their pseudo-gradients::

    delta_i <- x_prev - x_i            this worker's pseudo-gradient
    delta   <- combine_i(delta_i)      their fp32 mean, or one bit per entry
    x_prev  <- outer optimizer step of x_prev with gradient delta
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import torch

from signmuon.comm_hooks import VoteConfig

from .pseudo_gradients import RULES

__all__ = ["OuterStep", "PSEUDO_GRADIENTS"]

PSEUDO_GRADIENTS = tuple(RULES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterStep:
    """The outer step of rounds, passed whole to :class:`~signmuon.optim.LocalStepAverager`."""

    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    """Builds the outer optimizer over the consensus tensors. It gets one flat tensor per dtype
    and device (this rank's slice of it in node-aware rounds), so it must act entry by entry
    (SGD, Adam, AdamW); ``functools.partial(torch.optim.SGD, lr=1.0)`` is plain averaging."""

    pseudo_gradient: str = "mean"
    """How the workers' pseudo-gradients combine: ``"mean"`` (fp32 all-reduce, DiLoCo's),
    ``"sign_vote"`` (the majority vote of their signs, each tensor scaled by the workers' mean
    magnitude of its entries), ``"sign_vote_ef"`` (the same, each worker first adding what its
    scaled signs left out in earlier rounds: error feedback) or ``"scaled_sign"`` (1-bit Adam's
    error-feedback scaled signs, one scale per rank's chunk). All but the first send one bit
    per entry."""

    vote: VoteConfig | None = None
    """Settings of the ``"sign_vote"`` combination; its ``nonfinite`` and ``kernels`` also apply
    to ``"scaled_sign"``. Default ``VoteConfig(tie="exact")``: where the workers split evenly the
    consensus stays (a coin would move it along no direction they share). Free for two workers
    (each computes the vote); from three on, the entries left at zero travel back, up to a
    second bit per entry: ``tie="fast"`` keeps one bit."""

    scale_block: int = 0
    """Entries per scale of ``"sign_vote"`` and ``"sign_vote_ef"``: 0 scales each tensor as a
    whole; ``B`` scales each run of ``B`` entries of a tensor on its own (a 32-bit scale per
    block: ``32/B`` bits per entry more), so the voted signs keep more of the magnitudes. In
    node-aware rounds a tensor (or block) cut by the boundary of two rails' slices is scaled
    per piece."""

    SCALED: ClassVar[tuple[str, ...]] = tuple(name for name, rule in RULES.items() if rule.scaled)
    """The rules whose voted signs take ``scale_block`` and ``scale_bits``."""

    scale_bits: int = 32
    """Bits a scale travels in. 32: float32, averaged by an all-reduce. 16: bfloat16, the same
    all-reduce at half the bytes (8 significant bits). 8: a code on a grid of 2^(1/8) steps
    below the worker's largest scale (the float32 largest scale goes along), all-gathered and
    averaged on each rank: ``(M-1)·8/B`` bits per entry with M workers, the least of the three
    below M = 4 and as much as 16 at M = 4 (the all-reduce costs ``2(M-1)/M`` times the scale's
    bits). The error feedback keeps each worker's own scale in float32."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_block, bool) or not isinstance(self.scale_block, int) or self.scale_block < 0:
            raise ValueError(
                f"OuterStep.scale_block={self.scale_block!r} must be an int >= 0 (0: one scale per tensor)"
            )
        if isinstance(self.scale_bits, bool) or self.scale_bits not in (32, 16, 8):
            raise ValueError(f"OuterStep.scale_bits={self.scale_bits!r} must be 32, 16 or 8")
        if (self.scale_block or self.scale_bits != 32) and self.pseudo_gradient not in self.SCALED:
            raise ValueError(
                f"OuterStep.scale_block and scale_bits set the scales of {self.SCALED}; "
                f"pseudo_gradient={self.pseudo_gradient!r} has none"
            )
        if not callable(self.optimizer):
            raise ValueError(
                f"OuterStep.optimizer={self.optimizer!r} must build an optimizer from a list of tensors, "
                "e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
            )
        if self.pseudo_gradient not in PSEUDO_GRADIENTS:
            raise ValueError(f"pseudo_gradient={self.pseudo_gradient!r} must be one of {PSEUDO_GRADIENTS}")
        if self.vote is not None and not isinstance(self.vote, VoteConfig):
            raise ValueError(f"OuterStep.vote must be a VoteConfig, not {type(self.vote).__name__}")
        if self.vote is not None and self.vote.hierarchical:
            raise ValueError(
                "OuterStep.vote: hierarchical=True does not apply; pass layout= to LocalStepAverager for node-aware rounds"
            )

    @classmethod
    def diloco(cls, lr: float = 0.7, momentum: float = 0.9, pseudo_gradient: str = "mean") -> OuterStep:
        """DiLoCo's outer step: Nesterov SGD (``lr=0.7, momentum=0.9``) on the pseudo-gradient."""
        return cls(
            optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=True),
            pseudo_gradient=pseudo_gradient,
        )
