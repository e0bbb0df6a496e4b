"""The one writer of the commands' JSON reports, and its reader: a report is a JSON object whose
``command`` is the command line that made it, then the command's fields (``rows``, ``summary``,
``runs``, ...). The result tables in docs are made from these files."""

from __future__ import annotations

import json
import sys

__all__ = ["read_report", "write_report"]


def write_report(command: str, argv: list[str] | None, fields: dict, path: str | None) -> dict:
    """The JSON report of ``signmuon-bench command``: the command line that made it, then
    ``fields``; written to ``path`` when given. Returned either way."""
    report = {"command": f"signmuon-bench {command} " + " ".join(sys.argv[1:] if argv is None else argv), **fields}
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def read_report(path: str) -> dict:
    """A report :func:`write_report` wrote (a bare list of rows, as files from before it, reads
    as ``{"rows": [...]}``)."""
    with open(path) as f:
        report = json.load(f)
    return {"rows": report} if isinstance(report, list) else report
