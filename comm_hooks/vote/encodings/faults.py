"""Fault injection for robustness tests: Byzantine ranks that send wrong signs to the vote.

For testing only (the vote's Byzantine tolerance, Bernstein et al. ICLR 2019): pass a
:class:`ByzantineFault` as ``fault=`` to ``majority_vote``, a hook state or ``SignMuon``.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ByzantineFault", "FAULT_MODES"]

FAULT_MODES = ("flip", "random")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByzantineFault:
    """Ranks in ``ranks`` send flipped (``"flip"``) or random (``"random"``) signs.

    Zeros stay zeros (a faulty rank still abstains where it has no gradient).
    """

    ranks: tuple[int, ...]
    """The faulty ranks of the voting group."""
    mode: str = "flip"
    """``"flip"``: every nonzero sign negated; ``"random"``: every nonzero sign a coin flip."""
    seed: int = 0
    """Seed of the random signs."""

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {FAULT_MODES}")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def corrupt(self, positive: torch.Tensor, nonzero: torch.Tensor, rank: int, call_seed: int) -> torch.Tensor:
        """This rank's ``positive`` words as it sends them (unchanged unless it is faulty)."""
        if rank not in self.ranks:
            return positive
        if self.mode == "flip":
            return nonzero & ~positive
        gen = torch.Generator(device=positive.device).manual_seed(
            (self.seed * 7919 + call_seed * 104729 + rank) % (1 << 63)
        )
        coins = torch.randint(0, 256, (positive.numel() * 8,), dtype=torch.uint8, generator=gen, device=positive.device)
        return nonzero & coins.view(torch.int64)
