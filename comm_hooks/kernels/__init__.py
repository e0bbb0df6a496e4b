"""The kernels of the vote's per-rank pipeline, one family per device, one contract for all.

Each family module offers (``x`` flat and contiguous; planes are int64 words, entry ``64j+k``
at bit ``k`` of word ``j``, padding bits past the data set in both planes):

* ``pack(x, words) -> (positive, nonzero, zeros, nonfinite)``: both planes, the count of exact
  zeros and whether ``x`` holds NaN or Inf, in one read of ``x``;
* ``vote(positive, nonzero, dense, tie) -> (positive, nonzero)``: the majority of M voters'
  [M, S] planes (``dense[v]``, a host sequence of M bools: voter v has no zeros; ``tie``:
  tie-break bits or None);
* ``momentum_pack(buf, grad, weight, skip, words)``: Signum's momentum step
  ``buf.lerp_(grad, weight)`` (left out where the 0-d bool ``skip`` is set: a non-finite
  gradient), then ``pack(buf, words)``; Triton fuses both into one pass over the tensors,
  the CPU families run them one after the other (a fused numba loop measured slower);
* ``unpack(positive, nonzero, out)``: ±1 (0 where ``nonzero`` is clear) straight into ``out``;
* ``tie_words(segments, call_key, first_entry, words)``: the tie-break bits.

Families: ``cpu`` (numba, for CPU tensors), ``cuda`` (Triton, for CUDA tensors; pack and unpack
are Triton kernels, the vote over the 1/M packed shard runs as torch bit operations) and
``torch_ops`` (plain torch, any device). ``reference`` holds the slow definitions all of them
are tested against bit for bit.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

__all__ = ["kernels_for", "warm_up"]

_MODULES = {"numba": "cpu", "triton": "cuda", "torch": "torch_ops"}
_EXTRA = {
    "numba": "numba (a dependency of signmuon: pip install signmuon)",
    "triton": "triton (pip install 'signmuon[triton]')",
}


def kernels_for(device: torch.device, choice: str = "auto") -> ModuleType:
    """The kernel family for tensors on ``device``: ``"auto"``, ``"numba"``, ``"triton"`` or ``"torch"``.

    ``"auto"`` is numba on CPU, Triton on CUDA and torch elsewhere. Asking for a family that
    cannot run on ``device`` raises ``ValueError``; a missing package raises ``ImportError``
    naming what to install (no silent fallback to slower kernels).
    """
    device = torch.device(device)
    if choice == "auto":
        choice = {"cpu": "numba", "cuda": "triton"}.get(device.type, "torch")
    if choice == "numba" and device.type != "cpu":
        raise ValueError(f"kernels='numba' runs on CPU tensors, not {device.type}; use 'auto'")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernels='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), not {device.type}"
        )
    if choice not in _MODULES:
        raise ValueError(f"kernels={choice!r} names no kernel family; use 'auto', 'numba', 'triton' or 'torch'")
    try:
        return importlib.import_module(f"{__name__}.{_MODULES[choice]}")
    except ImportError as error:
        if choice == "torch":
            raise
        raise ImportError(
            f"the {choice} kernels need {_EXTRA[choice]}, or choose VoteConfig(kernels='torch') for the slower fallback"
        ) from error


def warm_up(device: torch.device | str, dtypes=(torch.float32,), choice: str = "auto") -> None:
    """Run every kernel of the family once on a tiny input of each of ``dtypes``, so the first
    compile (numba's, or loading its on-disk cache; Triton's) happens now, not in a timed region."""
    from .bits import SignSegments

    kernels = kernels_for(torch.device(device), choice)
    for dtype in dtypes:
        x = torch.tensor([1.0, -1.0, 0.0], dtype=dtype, device=device)
        positive, nonzero, _, _ = kernels.pack(x, 1)
        no_skip = torch.zeros((), dtype=torch.bool, device=device)
        for momentum_dtype in {dtype, torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype}:
            kernels.momentum_pack(
                torch.zeros(3, dtype=momentum_dtype, device=device), x, 0.1, no_skip, 1
            )  # hooks' kinds
        planes, masks = positive.repeat(2, 1), nonzero.repeat(2, 1)
        tie = kernels.tie_words(SignSegments((0, 3), (0,), (1,)), 0, 0, 1, positive.device)
        dense = (False, True)
        voted_positive, voted_nonzero = kernels.vote(planes, masks, dense, tie)
        kernels.unpack(voted_positive, voted_nonzero, torch.empty_like(x))
        kernels.unpack(voted_positive, None, torch.empty_like(x))
