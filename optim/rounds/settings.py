"""What a :class:`~signmuon.optim.LocalStepAverager` accepts and what must be equal on every
rank: its arguments checked at construction, and the settings each round compares."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch.distributed as dist

from signmuon.comm_hooks import NodeLayout
from signmuon.comm_hooks.dist import group_size_rank

from .outer_step import OuterStep

__all__ = [
    "DISTANCES",
    "SETTINGS",
    "averager_settings",
    "check_arguments",
    "check_int",
    "check_layout",
    "describe_factory",
]

DISTANCES = ("model", "tensor")


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


SETTINGS = (
    "period",
    "warmup_steps",
    "pull",
    "push",
    "eps",
    "distance",
    "average_buffers",
    "track_distances",
    "nonfinite",
    "sync_delay",
    "update_alpha",
)


def averager_settings(averager: Any) -> dict[str, Any]:
    """What must be equal on every rank."""
    settings = {name: getattr(averager, name) for name in SETTINGS}
    layout, outer = averager.layout, averager.outer
    nodes = None if layout is None else (layout.nodes, layout.ranks_per_node)
    if outer is not None:
        outer = (
            outer.pseudo_gradient,
            describe_factory(outer.optimizer),
            repr(outer.vote),
            outer.scale_block,
            outer.scale_bits,
        )
    fragments = [tuple(tuple(p.shape) for p in part.params) for part in averager.fragments]
    return {**settings, "outer": outer, "layout": nodes, "fragments": fragments}


def describe_factory(factory: Any) -> str:
    """The outer optimizer's factory by name and arguments, alike on every rank (a repr would
    carry a lambda's address)."""
    if isinstance(factory, functools.partial):
        return f"{describe_factory(factory.func)}{factory.args}{sorted(factory.keywords.items())}"
    return f"{getattr(factory, '__module__', '')}.{getattr(factory, '__qualname__', type(factory).__name__)}"


def check_arguments(
    pull: float, push: float, eps: float, distance: str, nonfinite: str, outer: Any, module: Any
) -> None:
    if not 0.0 <= pull <= 1.0:
        raise ValueError(f"pull={pull} must be in [0, 1]: beyond 1 a worker overshoots the average")
    if not (push >= 0.0 and math.isfinite(push)):
        raise ValueError(f"push={push} must be finite and >= 0")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite={nonfinite!r} must be 'skip' or 'raise'")
    if not eps > 0.0:
        raise ValueError(f"eps={eps} must be > 0")
    if distance not in DISTANCES:
        raise ValueError(f"distance={distance!r} must be one of {DISTANCES}")
    if outer is not None and not isinstance(outer, OuterStep):
        raise ValueError(f"outer must be an OuterStep, not {type(outer).__name__}")
    if outer is not None and module is None:
        raise ValueError("an outer step needs module=: the consensus starts as its parameters")


def check_layout(layout: NodeLayout | None, group: dist.ProcessGroup) -> NodeLayout | None:
    if layout is None:
        return None
    if not isinstance(layout, NodeLayout):
        raise ValueError(f"layout must be a NodeLayout (signmuon.comm_hooks.node_layout), not {type(layout).__name__}")
    if group_size_rank(group)[0] != layout.world_size:
        raise ValueError(
            f"layout= spans all {layout.world_size} ranks, process_group= {group_size_rank(group)[0]}: node-aware "
            "rounds run between all nodes; leave process_group unset"
        )
    if layout.nodes < 2:
        raise ValueError(
            "node-aware rounds need at least two nodes: on one node every step is all-reduced inside it "
            "and there is nothing to run rounds between; use plain DDP"
        )
    return None if layout.ranks_per_node == 1 else layout  # one rank per node: the flat rounds
