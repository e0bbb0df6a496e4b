"""Make the docs' result tables and figures again from the JSON reports in ``benchmarks/results``.

    signmuon-bench report            # rewrite every generated table and figure of the pages
    signmuon-bench report --check    # only say which tables disagree with their JSON (exit 1)

The pages are the README and ``docs/*.md``; what a page generates, and from which files, is
written in the page itself (:mod:`signmuon.benchmarks.reports.pages`).
"""

from __future__ import annotations

import glob
import os
import sys

from signmuon.benchmarks.reports.pages import regenerate, render_figures
from signmuon.benchmarks.runtime.cli import command_parser

NAME = "report"
SUMMARY = "the docs' result tables and figures, made again from benchmarks/results/*.json"

__all__ = ["main", "pages"]


def pages(root: str) -> list[str]:
    """The pages that may hold generated tables: the README and the docs."""
    return [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]


def main(argv: list[str] | None = None) -> list[str]:
    parser = command_parser(NAME, __doc__)
    parser.add_argument("--root", default=os.getcwd(), help="the repository (default: the current directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table disagrees")
    parser.add_argument("--no-figures", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, "benchmarks", "results")):
        parser.error(f"{args.root} has no benchmarks/results: run it in the repository or give --root")
    stale = []
    for page in pages(args.root):
        with open(page) as f:
            text = f.read()
        made = regenerate(text, args.root)
        if made != text:
            stale.append(os.path.relpath(page, args.root))
            if not args.check:
                with open(page, "w") as f:
                    f.write(made)
        if not (args.check or args.no_figures):
            for path in render_figures(made, os.path.dirname(page), args.root):
                print(f"wrote {os.path.relpath(path, args.root)}")
    if args.check:
        if stale:
            sys.exit(f"tables that disagree with their JSON: {', '.join(stale)} (run signmuon-bench report)")
        print("every generated table agrees with its JSON")
    else:
        print(f"rewrote {', '.join(stale)}" if stale else "every generated table was already up to date")
    return stale
