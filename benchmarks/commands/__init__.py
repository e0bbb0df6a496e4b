"""The ``signmuon-bench`` commands, one module each. A command module exports ``NAME`` (what
the user types), ``SUMMARY`` (one line for ``--help``) and ``main(argv)``; nothing imports a
command module but :func:`load`, so commands share code through the groups below them
(``runtime``, ``workloads``, ``methods``, ``runs``, ``reports``, ``cost``, ``netem``)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["COMMANDS", "load"]

COMMANDS = {
    name.replace("_", "-"): name
    for name in (
        "demo",
        "train",
        "bandwidth",
        "netem",
        "kernels",
        "ddp_step",
        "deepspeed_step",
        "ns_time",
        "direction_time",
        "sweep",
        "dppf_sweep",
        "round_time",
        "ns_precision",
        "plan",
        "report",
        "zero_structure",
        "lost_node",
    )
}
"""Command name -> its module in this package, in ``--help``'s order."""


def load(name: str) -> ModuleType:
    """The module of command ``name`` (KeyError naming the commands for an unknown one)."""
    if name not in COMMANDS:
        raise KeyError(f"no command {name!r}; the commands are {', '.join(COMMANDS)}")
    module = importlib.import_module(f"{__name__}.{COMMANDS[name]}")
    if module.NAME != name:
        raise RuntimeError(f"{module.__name__} says it is {module.NAME!r}, not {name!r}")
    return module
