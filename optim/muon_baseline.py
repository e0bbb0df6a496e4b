"""The Muon baseline: ``torch.optim.Muon`` on matrices, ``torch.optim.AdamW`` on the rest.

Benchmarks compare SignMuon against this on a plain all-reduce. The split follows SignMuon's
:func:`parameter_path`, with one difference forced by torch: ``torch.optim.Muon`` takes 2-D
parameters only, so conv kernels go to AdamW here (SignMuon treats them as matrices).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["MuonWithAdamW"]


class MuonWithAdamW:
    """Two torch optimizers stepped together, checkpointed together.

    Args:
        params: parameters (tensors, 2-D ones on Muon), or groups with ``use_muon`` as
            :func:`~signmuon.optim.muon_param_groups` builds them (embeddings and head on AdamW).
        lr: ``torch.optim.Muon``'s, on 2-D parameters.
        momentum: ``torch.optim.Muon``'s.
        weight_decay: ``torch.optim.Muon``'s.
        nesterov: ``torch.optim.Muon``'s.
        adamw_lr: ``torch.optim.AdamW``'s, on the other parameters.
        adamw_betas: ``torch.optim.AdamW``'s.
        adamw_eps: ``torch.optim.AdamW``'s.
        adamw_weight_decay: ``torch.optim.AdamW``'s.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        *,
        weight_decay: float = 0.0,
        nesterov: bool = True,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        matrices, others = [], []
        for item in params:
            # Tensors route by shape; groups (e.g. from muon_param_groups) by their "use_muon".
            group = item if isinstance(item, dict) else {"params": [item], "use_muon": None}
            for p in group["params"]:
                use_muon = group.get("use_muon")
                # torch.optim.Muon takes 2-D parameters only: conv kernels stay on AdamW here.
                is_matrix = p.dim() == 2 and (use_muon is None or bool(use_muon))
                (matrices if is_matrix else others).append(p)
        self.optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            self.optimizers.append(
                torch.optim.Muon(matrices, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
            )
        if others:
            self.optimizers.append(
                torch.optim.AdamW(
                    others, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay
                )
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(saved)} optimizers, this MuonWithAdamW {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, saved):
            opt.load_state_dict(state)
