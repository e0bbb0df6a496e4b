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
import statistics
from collections.abc import Callable

from signmuon.benchmarks.cost.projection import plot_projection
from signmuon.benchmarks.methods.registry import METHODS
from signmuon.benchmarks.reports.curves import time_to_target
from signmuon.benchmarks.reports.demo import summary_text
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


def _label(method: str) -> str:
    return METHODS[method].summary if method in METHODS else method


def _trains(reports: list[dict]) -> list[dict]:
    """The train reports inside ``reports``, each with the link rate it ran at ('' unshaped)."""
    out = []
    for report in reports:
        for inner in report.get("reports", [report]):
            train = inner.get("train", inner)
            if "summary" in train:
                out.append({**train, "rate": inner.get("rate", "")})
    return out


def _pm(pair: list[float], digits: int = 3) -> str:
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


# --- tables ------------------------------------------------------------------------------------


def time_to_target_table(reports: list[dict], baseline: str = "adamw", methods: str = "") -> str:
    """Training under ``netem`` at one or more link rates: per method the final test loss (mean ±
    std over seeds), MB sent per rank (between nodes when the ranks were grouped into nodes), and
    per rate the time to the target relative to ``baseline``'s at that rate, with the seeds that
    reached it."""
    trains = _trains(reports)
    first = trains[0]
    node_aware = any(r.get("ranks_per_node", 1) > 1 for r in reports[0].get("reports", []))
    order = methods.split(",") if methods else list(first["summary"])
    bytes_label = "MB between nodes / rank" if node_aware else "MB sent / rank"
    rates = [t["rate"].replace("mbit", " Mbit/s").replace("gbit", " Gbit/s") for t in trains]
    lines = [
        f"| method | final test loss | {bytes_label} | " + " | ".join(rates) + " |",
        "|---|---|---|" + "---|" * len(trains),
    ]
    for method in order:
        summary = first["summary"][method]
        runs = [r for r in first["runs"] if r["method"] == method]
        field = "bytes_between_nodes_per_rank" if node_aware else "bytes_per_rank"
        megabytes = statistics.fmean(r[field] for r in runs) / 1e6
        cells = []
        for train in trains:
            s, base = train["summary"][method], train["summary"][baseline]["time_to_target"]
            t, seeds = s["time_to_target"], f"({s['reached']}/{s['seeds']})"
            cells.append(
                "never" if not t else f"{t[0] / base[0]:.2f}× {seeds}" if base else f"{baseline} never {seeds}"
            )
        lines.append(f"| {_label(method)} | {_pm(summary['final'])} | {megabytes:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_table(reports: list[dict]) -> str:
    """Training runs without a shaped link (one row per method and strategy): final test loss,
    step time and MB between nodes per rank, each mean ± std over seeds (bytes: the mean)."""
    lines = ["| method | strategy | final test loss | step ms | MB between nodes / rank |", "|---|---|---|---|---|"]
    for train in _trains(reports):
        for method, summary in train["summary"].items():
            runs = [r for r in train["runs"] if r["method"] == method]
            between = statistics.fmean(r["bytes_between_nodes_per_rank"] for r in runs) / 1e6
            lines.append(
                f"| {_label(method)} | {runs[0].get('strategy', 'ddp')} | {_pm(summary['final'])} | "
                f"{_pm(summary['step_ms'], 1)} | {between:.2f} |"
            )
    return "\n".join(lines)


def step_table(reports: list[dict]) -> str:
    """``ddp-step`` rows: the median step, its ratio to the same method voting in ``step()``
    (``<method>_in_step`` of the same run), MB between nodes per rank, and the share of them
    sent during backward."""
    lines = [
        "| method | model parameters | step s | × the vote in step() | MB between nodes / rank | sent during backward |",
        "|---|---|---|---|---|---|",
    ]
    for report in reports:
        rows = {r["method"]: r for r in report["rows"]}
        for method, r in rows.items():
            if method.endswith("_in_step"):
                continue
            in_step = rows.get(f"{method}_in_step")
            ratio = f"{r['step_s'] / in_step['step_s']:.2f}×" if in_step else "-"
            lines.append(
                f"| {_label(method)} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {ratio} | "
                f"{r['between_nodes_bytes_per_rank'] / 1e6:.2f} | {r['between_nodes_in_backward_share']:.0%} |"
            )
    return "\n".join(lines)


def validation_table(reports: list[dict], within: str = "0.2") -> str:
    """``plan --validate``: predicted / measured step per layout, method and rate, and per
    layout how many points lie within ``within`` of 1."""
    rows = reports[0]["rows"]
    tolerance = float(within)
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    lines = ["| layout | method | " + " | ".join(rates) + " |", "|---|---|" + "---|" * len(rates)]
    for layout in dict.fromkeys(r["layout"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["layout"] == layout):
            cells = [
                f"{r['ratio']:.2f}"
                for rate in rates
                for r in rows
                if r["layout"] == layout and r["method"] == method and r["rate"] == rate
            ]
            lines.append(f"| {layout} | {method} | " + " | ".join(cells) + " |")
    counts = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        points = [r for r in rows if r["layout"] == layout]
        hits = sum(abs(r["ratio"] - 1) <= tolerance for r in points)
        counts.append(f"{layout}: {hits} of {len(points)}")
    lines.append("")
    lines.append(f"Predicted / measured within {tolerance:.0%}: " + "; ".join(counts) + ".")
    return "\n".join(lines)


def projection_table(
    reports: list[dict], columns: str = "25:8,100:8,100:512,400:512", methods: str = "signsgd_mv_node,signmuon_node"
) -> str:
    """``plan --projection``: per model, the step speed-up of ``methods`` (joined by " / ") over
    the faster fp32 all-reduce, at each ``link_gbit:nodes`` of ``columns``."""
    rows = [r for r in reports[0]["rows"] if "link_gbit" in r]
    points = [tuple(int(v) for v in c.split(":")) for c in columns.split(",")]
    wanted = methods.split(",")
    lines = [
        "| model | " + " | ".join(f"{g} Gbit/s, {n} nodes" for g, n in points) + " |",
        "|---|" + "---|" * len(points),
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for gbit, nodes in points:
            at = {
                r["method"]: r for r in rows if r["model"] == model and r["link_gbit"] == gbit and r["nodes"] == nodes
            }
            cells.append(" / ".join(f"{at[m]['speedup']:.2f}×" for m in wanted))
        lines.append(f"| {model.replace('gpt-', 'GPT ').upper()} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(reports: list[dict]) -> str:
    """``sweep``: per method the final test loss (mean ± std over seeds) at each learning-rate
    factor of any of the reports, the best in bold."""
    methods: dict[str, dict[float, dict]] = {}
    for report in reports:
        for method, summary in report["summary"].items():
            methods.setdefault(method, {}).update({float(k): v for k, v in summary["scales"].items()})
    scales = sorted({scale for cells in methods.values() for scale in cells})
    lines = ["| method | " + " | ".join(f"×{s:g}" for s in scales) + " |", "|---|" + "---|" * len(scales)]
    for method, cells in methods.items():
        best = min(cells, key=lambda scale: cells[scale]["mean"])
        row = []
        for scale in scales:
            cell = cells.get(scale)
            text = "" if cell is None else f"{cell['mean']:.3f} ± {cell['std']:.3f}"
            row.append(f"**{text}**" if scale == best else text)
        lines.append(f"| {_label(method)} | " + " | ".join(row) + " |")
    return "\n".join(lines)


CHOICE_NAMES = {
    "allreduce": "fp32 all-reduce",
    "allreduce_node": "fp32 all-reduce",
    "hsdp_allreduce": "HSDP (fp32)",
    "signsgd_mv_node": "Signum-MV",
    "signmuon_node": "SignMuon",
    "diloco_vote_node": "DiLoCo, one-bit rounds",
    "fsdp_signum_mv": "FSDP vote, Signum-MV",
    "fsdp_signmuon": "FSDP vote, SignMuon",
}
"""The plan's methods by the names of "Choosing a method"."""
MEASURED_AS = {
    "allreduce": "adamw",
    "allreduce_node": "adamw",
    "hsdp_allreduce": "adamw",
    "signsgd_mv_node": "signum_mv",
    "signmuon_node": "signmuon_node",
    "diloco_vote_node": "diloco_vote_32",
    "fsdp_signum_mv": "signum_mv",
    "fsdp_signmuon": "signmuon_node",
}
"""The measured training run that stands for each plan method's steps to the target (the FSDP vote
votes the node means as the node-aware DDP vote does: the same math)."""


def steps_factors(reports: list[dict]) -> tuple[float, dict[str, float | str]]:
    """From measured training (the first rate of each report): the target (the first adamw's
    target loss) and per run method the steps to it over the run's length, mean over seeds, or
    why there is none ("k/n seeds" reached it, "not measured" later)."""
    trains = [next(iter(_trains([r]))) for r in reports]
    target = next(t["target_loss"] for t in trains if t.get("target_loss") is not None and "adamw" in t["summary"])
    runs: dict[str, list[dict]] = {}
    for train in trains:
        for run in train["runs"]:
            runs.setdefault(run["method"], []).append(run)
    factors: dict[str, float | str] = {"adamw": 1.0}  # the target is adamw's mean final loss
    for key, group in runs.items():
        if key == "adamw":
            continue
        hits = [time_to_target(r["log"], target) for r in group]
        reached = [h[1] / r["log"][-1]["step"] for h, r in zip(hits, group) if h is not None]
        factors[key] = statistics.fmean(reached) if len(reached) == len(group) else f"{len(reached)}/{len(group)} seeds"
    return target, factors


def _choices(reports: list[dict]) -> tuple[list[dict], float, dict]:
    plan, measured = reports[0]["rows"], reports[1:]
    target, factors = steps_factors(measured)
    cells = []
    for model in dict.fromkeys(r["model"] for r in plan):
        for gbit in dict.fromkeys(r["link_gbit"] for r in plan):
            at = [r for r in plan if r["model"] == model and r["link_gbit"] == gbit]
            fp32 = min(r["step_s"] for r in at if MEASURED_AS[r["method"]] == "adamw")
            step = min(at, key=lambda r: r["step_s"])
            reaching = [
                (r["step_s"] * factors[MEASURED_AS[r["method"]]], r)
                for r in at
                if isinstance(factors.get(MEASURED_AS[r["method"]]), float)
            ]
            time, first = min(reaching, key=lambda pair: pair[0])
            cells.append(
                {
                    "model": model,
                    "link_gbit": gbit,
                    "nodes": at[0]["nodes"],
                    "fastest_step": step["method"],
                    "step_speedup": fp32 / step["step_s"],
                    "first_to_target": first["method"],
                    "target_speedup": fp32 / time,
                }
            )
    return cells, target, factors


def choice_table(reports: list[dict], which: str = "first_to_target") -> str:
    """ "Choosing a method": per model and link rate per GPU, the method with the fastest step
    (``which=fastest_step``, the plan's model alone) or the first to the target (its step times
    the measured steps to DDP+AdamW's final loss, ``which=first_to_target``), with its speed-up
    over the fp32 all-reduce (HSDP for sharded models)."""
    cells, _, _ = _choices(reports)
    key = "step_speedup" if which == "fastest_step" else "target_speedup"
    links = list(dict.fromkeys(c["link_gbit"] for c in cells))
    lines = ["| model | " + " | ".join(f"{g} Gbit/s" for g in links) + " |", "|---|" + "---|" * len(links)]
    for model in dict.fromkeys(c["model"] for c in cells):
        row = [c for c in cells if c["model"] == model]
        lines.append(
            f"| {model.replace('gpt-', 'GPT ').upper()} | "
            + " | ".join(f"{CHOICE_NAMES[c[which]]} {c[key]:.2f}×" for c in row)
            + " |"
        )
    return "\n".join(lines)


def steps_table(reports: list[dict]) -> str:
    """The measured steps to DDP+AdamW's final loss that :func:`choice_table` multiplies by."""
    target, factors = steps_factors(reports[1:])
    lines = [f"| plan method | measured as | steps to {target:.3f}, × DDP+AdamW's |", "|---|---|---|"]
    for method, measured in MEASURED_AS.items():
        if method in ("allreduce_node",):
            continue
        factor = factors.get(measured, "not measured")
        cell = f"{factor:.2f}" if isinstance(factor, float) else f"never ({factor})" if "seeds" in factor else factor
        lines.append(f"| {CHOICE_NAMES[method]} | {_label(measured)} | {cell} |")
    return "\n".join(lines)


def demo_output(reports: list[dict]) -> str:
    """What ``demo`` printed at the end of its run: its table and verdict, as a code block."""
    report = reports[0]
    return "```\n" + summary_text(report["rows"], report["link"], report["counted_by"]) + "\n```"


TABLES: dict[str, Callable[..., str]] = {
    "demo": demo_output,
    "time-to-target": time_to_target_table,
    "train": train_table,
    "step": step_table,
    "validation": validation_table,
    "projection": projection_table,
    "choice": choice_table,
    "steps": steps_table,
    "sweep": sweep_table,
}


# --- figures -----------------------------------------------------------------------------------


def _plot_choice(reports: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, target, _ = _choices(reports)
    models = list(dict.fromkeys(c["model"] for c in cells))
    links = list(dict.fromkeys(c["link_gbit"] for c in cells))
    names = list(dict.fromkeys(CHOICE_NAMES.values()))
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
    panels = (
        ("fastest_step", "step_speedup", "fastest step (the plan's model)"),
        ("first_to_target", "target_speedup", f"first to DDP+AdamW's loss {target:.3f} (× measured steps)"),
    )
    for ax, (which, key, title) in zip(axes, panels):
        for y, model in enumerate(models):
            for x, gbit in enumerate(links):
                cell = next(c for c in cells if c["model"] == model and c["link_gbit"] == gbit)
                name = CHOICE_NAMES[cell[which]]
                ax.add_patch(plt.Rectangle((x, y), 1, 1, color=colors[name], alpha=0.55))
                label = name.replace(", ", ",\n") + f"\n{cell[key]:.2f}×"
                ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(links))
        ax.set_ylim(0, len(models))
        ax.set_xticks([i + 0.5 for i in range(len(links))], [f"{g}" for g in links])
        ax.set_xlabel("link rate per GPU between nodes, Gbit/s")
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks([i + 0.5 for i in range(len(models))], models)
    fig.suptitle(
        f"{cells[0]['nodes']} nodes of 8 GPUs: the winner and its speed-up over fp32 (projection)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_projection(reports: list[dict], path: str) -> None:
    plot_projection([r for r in reports[0]["rows"] if "link_gbit" in r], path)


def _plot_rates(reports: list[dict], path: str) -> None:
    plot_rates(reports[0]["reports"], path)


FIGURES: dict[str, Callable[[list[dict], str], None]] = {
    "choice": _plot_choice,
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
