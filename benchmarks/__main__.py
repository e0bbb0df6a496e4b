"""``signmuon-bench COMMAND [options]`` (or ``python -m signmuon.benchmarks COMMAND``): dispatch
to the command's module (:mod:`signmuon.benchmarks.commands`); ``signmuon-bench`` alone lists them."""

from __future__ import annotations

import sys

from signmuon.benchmarks.commands import COMMANDS, load
from signmuon.benchmarks.runtime.launch import end_torchrun_process


def usage() -> str:
    """The command list, one line each, from the commands' own summaries."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {load(name).SUMMARY}" for name in COMMANDS]
    return "usage: signmuon-bench COMMAND [options]  (COMMAND --help for its options)\n\nCommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        sys.exit(f"signmuon-bench: unknown command {argv[0]!r}\n{usage()}")
    load(argv[0]).main(argv[1:])
    end_torchrun_process()


if __name__ == "__main__":
    main()
