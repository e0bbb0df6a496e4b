"""The sign-vote optimizers by name, built from a ``{"type": ..., "params": {...}}`` spec (a
DeepSpeed config's optimizer section, or the same dict given to the HF Trainer)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from .sign_muon import SignMuon
from .sign_vote import SignVoteOptimizer
from .signum import SignSGDMV, SignumMV

__all__ = ["SIGN_OPTIMIZERS", "sign_optimizer_from_spec"]


SIGN_OPTIMIZERS: dict[str, type[SignVoteOptimizer]] = {
    "signmuon": SignMuon,
    "signummv": SignumMV,
    "signsgdmv": SignSGDMV,
}


def sign_optimizer_from_spec(
    spec: dict[str, Any],
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    reserved: Iterable[str] = (),
    **fixed: Any,
) -> SignVoteOptimizer:
    """Build ``SignMuon`` / ``SignumMV`` / ``SignSGDMV`` from ``{"type": name, "params": {...}}``
    (a DeepSpeed config's optimizer section, or the same dict given to the HF Trainer).

    The name matches in any case; unknown or ``reserved`` keys (those the caller sets itself,
    passed in ``fixed``) raise ``ValueError`` listing the valid ones.
    """
    if not isinstance(spec, dict):
        raise TypeError(
            f"the optimizer spec must be a dict like {{'type': 'SignMuon', 'params': {{...}}}}, got {type(spec).__name__}"
        )
    name = str(spec.get("type", ""))
    cls = SIGN_OPTIMIZERS.get(name.lower())
    if cls is None:
        raise ValueError(
            f"optimizer type {name!r} is not one of ours: {[c.__name__ for c in SIGN_OPTIMIZERS.values()]}"
        )
    unexpected = sorted(set(spec) - {"type", "params"})
    if unexpected:
        raise ValueError(f"unknown keys {unexpected} in the optimizer spec; it has 'type' and 'params'")
    given = dict(spec.get("params", {}))
    allowed = sorted(n for n in _init_parameters(cls) if n not in ("params", *reserved, *fixed))
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"unknown params {unknown} for optimizer {name}; valid: {allowed}")
    return cls(params, **given, **fixed)


def _init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: its ``__init__``'s, and where that passes
    ``**options`` on, its bases' too, less the class's ``fixed_settings``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return names - set(getattr(cls, "fixed_settings", ()))
