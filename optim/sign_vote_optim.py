"""Signum and signSGD with majority vote, as optimizers (no Newton–Schulz anywhere).

The same machinery as :class:`SignMuon`, with every parameter on its Signum path:
``m <- beta*m + (1-beta)*g`` on each worker, ``W <- W - lr*vote(sign(m)) - lr*lambda*W``
(Bernstein et al., ICLR 2019). ``momentum=0`` is signSGD-MV. Under DDP the plain
``sign_vote_hook`` + ``torch.optim.SGD`` does the same with per-bucket momentum; these
classes serve where the optimizer must own the momentum (DeepSpeed, ``vote_in_step``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks import VoteConfig

from .sign_muon import SignMuon

__all__ = ["SIGN_OPTIMIZERS", "SignumMV", "SignSGDMV", "sign_optimizer_from_spec"]


class SignumMV(SignMuon):
    """Signum with majority vote.

    Args:
        params: parameters or param groups.
        lr: each entry moves by ``lr`` per step (or 0 where the vote is 0).
        momentum: beta in [0, 1).
        weight_decay: decoupled weight decay.
        vote: as :class:`SignMuon`.
        process_group: as :class:`SignMuon`.
        vote_in_step: as :class:`SignMuon`.
        checkpoint_all_ranks: as :class:`SignMuon`.
    """

    _default_use_muon = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.9,
        *,
        weight_decay: float = 0.0,
        vote: VoteConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        vote_in_step: bool = False,
        checkpoint_all_ranks: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            momentum,
            nesterov=False,
            weight_decay=weight_decay,
            non_matrix="signum",
            vote=vote,
            process_group=process_group,
            vote_in_step=vote_in_step,
            checkpoint_all_ranks=checkpoint_all_ranks,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("use_muon") or param_group.get("non_matrix", "signum") != "signum":
            raise ValueError(f"{type(self).__name__} votes the sign of every parameter; use SignMuon for other paths")
        super().add_param_group(param_group)


class SignSGDMV(SignumMV):
    """signSGD with majority vote: Signum without momentum (each worker votes sign(g))."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.0,
        vote: VoteConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        vote_in_step: bool = False,
        checkpoint_all_ranks: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            0.0,
            weight_decay=weight_decay,
            vote=vote,
            process_group=process_group,
            vote_in_step=vote_in_step,
            checkpoint_all_ranks=checkpoint_all_ranks,
        )


SIGN_OPTIMIZERS: dict[str, type[SignMuon]] = {"signmuon": SignMuon, "signummv": SignumMV, "signsgdmv": SignSGDMV}


def sign_optimizer_from_spec(
    spec: dict[str, Any], params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], reserved: Iterable[str] = (), **fixed: Any
) -> SignMuon:
    """Build ``SignMuon`` / ``SignumMV`` / ``SignSGDMV`` from ``{"type": name, "params": {...}}``
    (a DeepSpeed config's optimizer section, or the same dict given to the HF Trainer).

    The name matches in any case; unknown or ``reserved`` keys (those the caller sets itself,
    passed in ``fixed``) raise ``ValueError`` listing the valid ones.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"the optimizer spec must be a dict like {{'type': 'SignMuon', 'params': {{...}}}}, got {type(spec).__name__}")
    name = str(spec.get("type", ""))
    cls = SIGN_OPTIMIZERS.get(name.lower())
    if cls is None:
        raise ValueError(f"optimizer type {name!r} is not one of ours: {[c.__name__ for c in SIGN_OPTIMIZERS.values()]}")
    unexpected = sorted(set(spec) - {"type", "params"})
    if unexpected:
        raise ValueError(f"unknown keys {unexpected} in the optimizer spec; it has 'type' and 'params'")
    given = dict(spec.get("params", {}))
    names = inspect.signature(cls.__init__).parameters
    allowed = sorted(n for n in names if n not in ("self", "params", *reserved, *fixed))
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"unknown params {unknown} for optimizer {name}; valid: {allowed}")
    return cls(params, **given, **fixed)
