"""The method registry: which methods a command runs (:func:`names_for`), what it builds each
with (:func:`builder`), and its ``--methods`` option; the methods themselves are the table of
:mod:`.table` (``METHODS``, re-exported here).

A command runs the methods that have a builder for it (:func:`names_for`), each through
:func:`builder`; ``--help`` lists them from here, and a name from before the registry gets a
one-line error naming its successor.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from signmuon.benchmarks.methods.table import METHODS, RENAMED, Method

__all__ = [
    "METHODS",
    "RENAMED",
    "Method",
    "add_methods_option",
    "builder",
    "check_methods",
    "describe",
    "names_for",
    "parse_methods",
    "plan_model",
]


def names_for(command: str) -> tuple[str, ...]:
    """The methods ``command`` runs, in the registry's order."""
    return tuple(name for name, method in METHODS.items() if command in method.builders)


def plan_model(name: str) -> str | None:
    """The plan's model of method ``name``'s traffic: itself where ``plan`` runs it, else its
    ``plan_as``; None where the plan has no model of it."""
    method = METHODS[name]
    return name if "plan" in method.builders else method.plan_as


def builder(name: str, command: str) -> Callable:
    """What ``command`` builds ``name`` with (ValueError naming the methods it runs)."""
    method = METHODS.get(name)
    if method is None or command not in method.builders:
        raise ValueError(f"{command} has no method {name!r}; it runs {', '.join(names_for(command))}")
    return method.builders[command]


def describe(command: str) -> str:
    """``--help``'s list of ``command``'s methods, one per line."""
    names = names_for(command)
    width = max(map(len, names))
    return "methods:\n" + "\n".join(f"  {name:<{width}}  {METHODS[name].summary}" for name in names)


def check_methods(parser: argparse.ArgumentParser, command: str, methods: list[str]) -> None:
    """A one-line parser error (exit 2) for a method ``command`` does not run, naming the
    successor of a renamed one."""
    valid = names_for(command)
    for method in methods:
        if method in RENAMED and RENAMED[method] in valid:
            parser.error(f"--methods: {method!r} is now called {RENAMED[method]!r}")
    unknown = [m for m in methods if m not in valid]
    if unknown:
        parser.error(f"--methods: unknown method(s) {unknown} for {command}; choose from {', '.join(valid)}")


def add_methods_option(parser: argparse.ArgumentParser, command: str, default: list[str] | None = None) -> None:
    """A ``--methods`` option taking ``command``'s methods (``--help`` lists them; default
    ``default``, or all of them); :func:`parse_methods` checks them."""
    parser.epilog = describe(command)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(names_for(command)) if default is None else default,
        metavar="METHOD",
        help="methods to run, listed below (default: %(default)s)",
    )
    parser.set_defaults(methods_of=command)


def parse_methods(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then a one-line error (exit 2) for a method the command does not run."""
    args = parser.parse_args(argv)
    check_methods(parser, args.methods_of, args.methods)
    return args
