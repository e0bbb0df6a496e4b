"""Which tensors take part in a round, in which order and under which names: a module's
trained parameters, the parameters an optimizer hands over, their groups by dtype and device,
and the consensus written back under every name of a tied tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from signmuon.comm_hooks.dist import flatten, mean_all_reduce, split_like, unflatten_into

from ..params import local_tensor
from .aliases import clone_once

__all__ = [
    "all_names",
    "all_params",
    "by_dtype_and_device",
    "consensus_state",
    "distinct",
    "first_names",
    "in_module_order",
    "local_groups",
    "trained",
    "write_consensus",
]


def in_module_order(module: nn.Module, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``module``'s parameters that require grad, in its order, if ``params`` are exactly those
    (an optimizer may group them otherwise, as Muon's matrices-and-the-rest groups do)."""
    expected = [p for p in module.parameters() if p.requires_grad]
    if len(params) != len(expected) or {id(p) for p in params} != {id(p) for p in expected}:
        raise ValueError(
            "the parameters given to the round are not those the consensus was made of (LocalStepAverager(module=...)'s "
            "parameters that require grad, in any order): average_parameters must get the same parameters every time"
        )
    return expected


def trained(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters that require grad, in its order, a tied one once."""
    return [p for p in module.parameters() if p.requires_grad]


def first_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its first name in ``module``."""
    return {id(p): name for name, p in module.named_parameters()}


def all_names(module: nn.Module) -> dict[int, list[str]]:
    """``id(parameter)`` -> every name it has in ``module`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each object once (a state dict's tied names share one)."""
    return list({id(t): t for t in tensors}.values())


def write_consensus(
    whole: torch.Tensor, params: list[torch.Tensor], names: dict[int, list[str]], state: dict[str, torch.Tensor]
) -> set[int]:
    """Copy the consensus ``whole`` of ``params`` into ``state`` under every name of each
    parameter; returns the ids of the tensors written."""
    written: set[int] = set()
    for p, value in zip(params, split_like(whole, [local_tensor(p) for p in params])):
        for name in names[id(p)]:
            target = state.get(name)
            if target is not None and id(target) not in written:
                local_tensor(target).copy_(value)
                written.add(id(target))
    return written


def all_params(params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``params`` (tensors or param groups), in order, each once."""
    found: dict[torch.Tensor, None] = {}
    for item in params:
        for p in item["params"] if isinstance(item, dict) else [item]:
            found.setdefault(p, None)
    return list(found)


def by_dtype_and_device(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors so each group flattens into one buffer without casting: one collective each."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def consensus_state(
    module: nn.Module, parts: list[tuple[list[torch.Tensor], list[torch.Tensor]]], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` cloned, each part's parameters (by dtype and device) replaced by
    the consensus of their groups (``parts``: (parameters, consensus of each group) per fragment;
    none without an outer step), every other floating-point tensor by its mean over ``group``:
    a collective, not counted in any statistics."""
    state = clone_once(module.state_dict())
    written: set[int] = set()
    names = all_names(module)
    for params, wholes in parts:
        for tensors, whole in zip(by_dtype_and_device(params), wholes):
            written |= write_consensus(whole, tensors, names, state)
    floats = [v for v in distinct(state.values()) if v.is_floating_point() and id(v) not in written]
    for tensors in by_dtype_and_device(floats):
        unflatten_into(
            mean_all_reduce(flatten([local_tensor(v) for v in tensors]), group),
            [local_tensor(v) for v in tensors],
        )
    return state


def local_groups(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params``' local tensors (FSDP2: this rank's shards) by dtype and device."""
    return by_dtype_and_device(local_tensor(p) for p in params)
