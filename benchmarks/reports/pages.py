"""The docs' result tables and figures, made from the JSON reports in ``benchmarks/results``.

A page holds a generated table between two comments, the first naming what makes it::

    <!-- report KIND FILE [FILE ...] [key=value ...] -->
    | generated | table |
    <!-- /report -->

and a generated figure as a comment before its image::

    <!-- figure KIND OUT.png FILE [FILE ...] -->
    ![caption](figures/OUT.png)

``signmuon-bench report`` rewrites every such table and figure; ``--check`` only says which
tables disagree with their JSON. KIND is a key of :data:`TABLES` or :data:`FIGURES`; FILE paths
are relative to the repository root; OUT paths to the page.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable

from signmuon.benchmarks.cost.projection import plot_projection
from signmuon.benchmarks.reports import tables
from signmuon.benchmarks.reports.choice import choice_table, plot_choice, steps_table
from signmuon.benchmarks.reports.conformance import conformance_table
from signmuon.benchmarks.reports.rates import plot_rates
from signmuon.benchmarks.reports.writer import read_report

__all__ = ["FIGURES", "TABLES", "figure_specs", "regenerate", "render_figures"]

TABLE_BLOCK = re.compile(r"<!-- report (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- /report -->", re.S)
FIGURE_SPEC = re.compile(r"<!-- figure (?P<spec>[^>]*?) -->")


def _parse(spec: str) -> tuple[str, list[str], dict[str, str]]:
    kind, *rest = spec.split()
    files = [w for w in rest if "=" not in w]
    options = dict(w.split("=", 1) for w in rest if "=" in w)
    return kind, files, options


TABLES: dict[str, Callable[..., str]] = {
    "demo": tables.demo_output,
    "time-to-target": tables.time_to_target_table,
    "train": tables.train_table,
    "step": tables.step_table,
    "streaming": tables.streaming_table,
    "zero-step": tables.zero_step_table,
    "validation": tables.validation_table,
    "projection": tables.projection_table,
    "sweep": tables.sweep_table,
    "choice": choice_table,
    "steps": steps_table,
    "conformance": conformance_table,
}
"""Table kinds a page may name, and what makes each (:mod:`.tables`, :mod:`.choice`)."""


# --- figures -----------------------------------------------------------------------------------


def _plot_projection(reports: list[dict], path: str) -> None:
    plot_projection([r for r in reports[0]["rows"] if "link_gbit" in r], path)


def _plot_rates(reports: list[dict], path: str) -> None:
    plot_rates(reports[0]["reports"], path)


FIGURES: dict[str, Callable[[list[dict], str], None]] = {
    "choice": plot_choice,
    "projection": _plot_projection,
    "rates": _plot_rates,
}


# --- pages -------------------------------------------------------------------------------------


def _reports(files: list[str], root: str) -> list[dict]:
    missing = [f for f in files if not os.path.exists(os.path.join(root, f))]
    if missing or not files:
        raise FileNotFoundError(f"report files {missing or '(none named)'} not found under {root}")
    return [read_report(os.path.join(root, f)) for f in files]


def regenerate(text: str, root: str) -> str:
    """``text`` (a page) with every generated table made again from its JSON."""

    def render(match: re.Match) -> str:
        kind, files, options = _parse(match["spec"])
        if kind not in TABLES:
            raise ValueError(f"unknown report table {kind!r} (known: {', '.join(TABLES)})")
        known = list(inspect.signature(TABLES[kind]).parameters)[1:]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"report table {kind!r} has no option {', '.join(unknown)} (its options: {known})")
        table = TABLES[kind](_reports(files, root), **options)
        return f"<!-- report {match['spec']} -->\n{table}\n<!-- /report -->"

    return TABLE_BLOCK.sub(render, text)


def figure_specs(text: str) -> list[tuple[str, str, list[str]]]:
    """(kind, output path relative to the page, JSON files) of every generated figure of a page."""
    specs = []
    for match in FIGURE_SPEC.finditer(text):
        kind, (out, *files), _ = _parse(match["spec"])
        if kind not in FIGURES:
            raise ValueError(f"unknown report figure {kind!r} (known: {', '.join(FIGURES)})")
        specs.append((kind, out, files))
    return specs


def render_figures(text: str, page_dir: str, root: str) -> list[str]:
    """Draw every generated figure of a page; the paths written."""
    written = []
    for kind, out, files in figure_specs(text):
        path = os.path.join(page_dir, out)
        FIGURES[kind](_reports(files, root), path)
        written.append(path)
    return written
