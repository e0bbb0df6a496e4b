"""Tensors that share memory. Tied weights are one tensor under several names (GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``): a round moves it once and a consensus gives
every name its value. Two different tensors over the same memory (weights tied by sharing
``.data`` rather than the Parameter) cannot be stepped once each, so rounds refuse them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..params import local_tensor

__all__ = ["clone_once", "first_overlap", "memory_key", "refuse_shared_memory"]


def _span(tensor: torch.Tensor) -> tuple[Any, int, int] | None:
    """(storage, first byte, past the last byte) of the entries of ``tensor`` (its local shard
    under FSDP2), or None for an empty, meta or sparse tensor, which holds no memory to share."""
    t = local_tensor(tensor)
    if t.numel() == 0 or t.device.type == "meta" or t.layout != torch.strided:
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    last = first + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size
    return (t.device, t.untyped_storage().data_ptr()), first, last


def memory_key(tensor: torch.Tensor) -> tuple | None:
    """Alike for every view of the very same entries (the names of one tied tensor), else
    different; None where ``tensor`` holds no memory."""
    span = _span(tensor)
    if span is None:
        return None
    t = local_tensor(tensor)
    return (*span, tuple(t.shape), tuple(t.stride()), t.dtype)


def first_overlap(named: Iterable[tuple[str, torch.Tensor]], *, same_view_ok: bool) -> tuple[str, str] | None:
    """The names of two tensors that share memory, or None; views of the very same entries
    count only where not ``same_view_ok``."""
    spans = sorted(
        ((span, memory_key(t), name) for name, t in named if (span := _span(t)) is not None),
        key=lambda entry: (str(entry[0][0]), entry[0][1]),
    )
    furthest = None  # (storage, end, key, name) of the span reaching furthest in the storage so far
    for (storage, first, last), key, name in spans:
        if furthest is not None and furthest[0] == storage and first < furthest[1]:
            if not (same_view_ok and key == furthest[2]):
                return furthest[3], name
        if furthest is None or furthest[0] != storage or last > furthest[1]:
            furthest = (storage, last, key, name)
    return None


def refuse_shared_memory(params: list[torch.Tensor], names: Mapping[int, str] | None = None) -> None:
    """Raise unless the tensors of ``params`` (one entry per tensor) hold disjoint memory.
    ``names`` maps ``id(param)`` to its name for the message."""
    names = names or {}
    named = [(names.get(id(p), f"parameter {i} (shape {tuple(p.shape)})"), p) for i, p in enumerate(params)]
    pair = first_overlap(named, same_view_ok=False)
    if pair is not None:
        raise ValueError(
            f"{pair[0]} and {pair[1]} are different tensors over the same memory (weights tied by sharing .data, "
            "not the Parameter): a round would move that memory once for each. Tie them as one Parameter "
            "(model.head.weight = model.embed.weight), as transformers' tie_weights does"
        )


def clone_once(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor cloned once: the names of one tensor (tied weights) share one
    clone, as they share one tensor in the module, so what is written under one is under all.
    A tensor that overlaps another without being the same view is refused."""
    pair = first_overlap(state.items(), same_view_ok=True)
    if pair is not None:
        raise ValueError(
            f"the state dict's {pair[0]} and {pair[1]} overlap in memory without being one tensor: "
            "their consensus values would overwrite each other when loaded"
        )
    clones: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, value in state.items():
        key = memory_key(value)
        if key is None:
            out[name] = value.detach().clone()
            continue
        if key not in clones:
            clones[key] = value.detach().clone()
        out[name] = clones[key]
    return out
