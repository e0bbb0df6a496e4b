"""Who votes under DDP: the process group the DistributedDataParallel model already reduces over.

DDP hands its communication hook buckets but not its process group, and a hook state made
without one would vote over WORLD: under tensor or pipeline parallelism (DDP over a
data-parallel sub-group) that mixes other groups' signs into each group's update, silently. So
the hook states learn DDP's group at their first call, and refuse a group that differs.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["ddp_model_of", "group_ranks", "resolve_group"]


def ddp_model_of(params: Sequence[torch.Tensor]) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP model that holds ``params`` (a bucket's), or None where no DDP model does (the
    backward reducer, a hook called by hand). One scan of the live objects: the hook states ask
    once, at their first call."""
    if not params:
        return None
    first = params[0]
    ddp = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        if isinstance(obj, ddp) and any(p is first for p in obj.module.parameters()):
            return obj
    return None


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """The global ranks of ``group`` (None: WORLD), or None for a group outside torch's registry."""
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, KeyError):
        return None


def resolve_group(
    given: dist.ProcessGroup | None, ddp_group: dist.ProcessGroup | None, who: str
) -> tuple[dist.ProcessGroup | None, str | None]:
    """(the group to vote over, why it cannot be used or None): DDP's group where none was given;
    the given one where it has DDP's ranks; else the reason to refuse, naming both."""
    if ddp_group is None or not (dist.is_available() and dist.is_initialized()):
        return given, None
    if given is None:
        return ddp_group, None
    mine, ddps = group_ranks(given), group_ranks(ddp_group)
    if given is ddp_group or mine is None or ddps is None or mine == ddps:
        return given, None
    return given, (
        f"{who} votes over ranks {list(mine)}, but the DistributedDataParallel model it is registered on "
        f"reduces over ranks {list(ddps)}: give it DDP's process group (or none: it then takes DDP's)"
    )
