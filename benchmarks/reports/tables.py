"""The result tables of the docs, each made from JSON reports (what ``signmuon-bench report``
writes into a page; :mod:`signmuon.benchmarks.reports.pages`). Each takes the reports its page
names and its options as strings, and returns a Markdown table."""

from __future__ import annotations

import statistics

from signmuon.benchmarks.methods.registry import METHODS
from signmuon.benchmarks.reports.demo import summary_text

__all__ = [
    "demo_output",
    "mean_std_text",
    "method_label",
    "projection_table",
    "step_table",
    "streaming_table",
    "sweep_table",
    "time_to_target_table",
    "train_reports",
    "train_table",
    "validation_table",
]


def method_label(method: str) -> str:
    """The registry's one-line summary of ``method`` (the name itself if it has none)."""
    return METHODS[method].summary if method in METHODS else method


def train_reports(reports: list[dict]) -> list[dict]:
    """The train reports inside ``reports``, each with the link rate it ran at ('' unshaped)."""
    out = []
    for report in reports:
        for inner in report.get("reports", [report]):
            train = inner.get("train", inner)
            if "summary" in train:
                out.append({**train, "rate": inner.get("rate", "")})
    return out


def mean_std_text(pair: list[float], digits: int = 3) -> str:
    """``mean ± std`` of a (mean, std) pair."""
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def time_to_target_table(reports: list[dict], baseline: str = "adamw", methods: str = "") -> str:
    """Training under ``netem`` at one or more link rates: per method the final test loss (mean ±
    std over seeds), MB sent per rank (between nodes when the ranks were grouped into nodes), and
    per rate the time to the target relative to ``baseline``'s at that rate, with the seeds that
    reached it. The learning-rate factor is marked '*' where the sweep tuned it, '~' where it
    was tuned for the same optimizer, and bare at the default."""
    trains = train_reports(reports)
    first = trains[0]
    node_aware = any(r.get("ranks_per_node", 1) > 1 for r in reports[0].get("reports", []))
    order = methods.split(",") if methods else list(first["summary"])
    bytes_label = "MB between nodes / rank" if node_aware else "MB sent / rank"
    rates = [t["rate"].replace("mbit", " Mbit/s").replace("gbit", " Gbit/s") for t in trains]
    lines = [
        f"| method | lr × | final test loss | {bytes_label} | " + " | ".join(rates) + " |",
        "|---|---|---|---|" + "---|" * len(trains),
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
        mark = "*" if runs[0].get("lr_tuned") else "~" if runs[0].get("lr_borrowed") else ""
        lines.append(
            f"| {method_label(method)} | {runs[0].get('lr_scale', 1.0):g}{mark} | "
            f"{mean_std_text(summary['final'])} | {megabytes:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def train_table(reports: list[dict]) -> str:
    """Training runs without a shaped link (one row per method and strategy): final test loss,
    step time and MB between nodes per rank, each mean ± std over seeds (bytes: the mean)."""
    lines = ["| method | strategy | final test loss | step ms | MB between nodes / rank |", "|---|---|---|---|---|"]
    for train in train_reports(reports):
        for method, summary in train["summary"].items():
            runs = [r for r in train["runs"] if r["method"] == method]
            between = statistics.fmean(r["bytes_between_nodes_per_rank"] for r in runs) / 1e6
            lines.append(
                f"| {method_label(method)} | {runs[0].get('strategy', 'ddp')} | {mean_std_text(summary['final'])} | "
                f"{mean_std_text(summary['step_ms'], 1)} | {between:.2f} |"
            )
    return "\n".join(lines)


def streaming_table(reports: list[dict], baseline: str, target: str) -> str:
    """Rounds with and without fragments, the runs of every report pooled per method: final
    test loss (mean ± std over seeds), MB between nodes per rank, the largest burst (the most
    one rank sent between nodes in one step, the largest over seeds) and its ratio to
    ``baseline``'s, the share of the rounds' wire time hidden behind compute (mean over seeds),
    and the time to test loss ``target`` of each seed in seed order ('never' where it is not reached)."""
    from signmuon.benchmarks.reports.curves import seed_summary, time_to_target

    runs: dict[str, list[dict]] = {}
    for train in train_reports(reports):
        for run in train["runs"]:
            runs.setdefault(run["method"], []).append(run)
    burst = {m: max(r["largest_burst_between_nodes_per_rank"] for r in rs) for m, rs in runs.items()}
    lines = [
        "| method | seeds | final test loss | MB between nodes / rank | largest burst, KB / rank "
        f"| × {baseline}'s burst | round wire time hidden | s to loss {target}, per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, method_runs in runs.items():
        summary = seed_summary(method_runs, float(target))
        hits = [time_to_target(r["log"], float(target)) for r in sorted(method_runs, key=lambda r: r["seed"])]
        reached = ", ".join("never" if hit is None else f"{hit[0]:.0f}" for hit in hits)
        shares = [r["round_hidden_share"] for r in method_runs if r.get("round_hidden_share") is not None]
        hidden = f"{100 * statistics.fmean(shares):.0f}%" if shares else "-"
        between = statistics.fmean(r["bytes_between_nodes_per_rank"] for r in method_runs) / 1e6
        lines.append(
            f"| {method_label(method)} | {len(method_runs)} | {mean_std_text(summary['final'])} | {between:.2f} "
            f"| {burst[method] / 1e3:.1f} | {burst[method] / burst[baseline]:.2f} | {hidden} | {reached} |"
        )
    return "\n".join(lines)


def _link_of(command: str) -> str:
    """The link between nodes a report's command ran on: netem's ``--rate``, else loopback."""
    words = command.split()
    if "netem" in words and "--rate" in words:
        return words[words.index("--rate") + 1]
    return "loopback"


def step_table(reports: list[dict]) -> str:
    """``ddp-step`` rows: the link between nodes, the median step, its ratio to the same method
    voting in ``step()`` (``<method>_in_step`` of the same run), MB between nodes per rank, and
    the share of them sent during backward."""
    lines = [
        "| method | link | model parameters | step s | × the vote in step() | MB between nodes / rank "
        "| sent during backward |",
        "|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        link = _link_of(report.get("command", ""))
        rows = {r["method"]: r for r in report["rows"]}
        for method, r in rows.items():
            if method.endswith("_in_step"):
                continue
            in_step = rows.get(f"{method}_in_step")
            ratio = f"{r['step_s'] / in_step['step_s']:.2f}×" if in_step else "-"
            lines.append(
                f"| {method_label(method)} | {link} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {ratio} | "
                f"{r['between_nodes_bytes_per_rank'] / 1e6:.2f} | {r['between_nodes_in_backward_share']:.0%} |"
            )
    return "\n".join(lines)


def zero_step_table(reports: list[dict], base: str = "zero2_adamw") -> str:
    """``deepspeed-step`` under ``netem`` (each file one report per rate): the median step, its ratio to
    ``base`` of the same run, the payload between nodes from the interfaces' counters (mean over
    nodes) and the largest rank's optimizer state in units of 4 bytes per parameter."""
    lines = [
        "| method | link | step ms | × DeepSpeed ZeRO-2 AdamW | KB between nodes / node / step "
        "| optimizer state / rank (× 4 B × params) |",
        "|---|---|---|---|---|---|",
    ]
    for report in [one for file in reports for one in file["reports"]]:
        rows = {r["method"]: r for r in report["rows"]}
        for method, r in rows.items():
            payload = statistics.mean(r["interface_payload_bytes_per_node"]) / 1e3
            state = r["state_bytes_max_rank"] / (4 * r["params"])
            lines.append(
                f"| {method_label(method)} | {report['rate']} | {r['step_s'] * 1e3:.0f} | "
                f"{r['step_s'] / rows[base]['step_s']:.3f}× | {payload:.1f} | {state:.3f} |"
            )
    return "\n".join(lines)


def validation_table(reports: list[dict], within: str = "0.2") -> str:
    """``plan --validate``: predicted / measured step per layout, method and rate (and, where the
    report has them, each vote's zeros' bits and kernel time from the unshaped run), and per
    layout how many points lie within ``within`` of 1."""
    rows = reports[0]["rows"]
    tolerance = float(within)
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    inputs = all("vote_inputs_from_run" in r for r in rows)  # the vote's zeros and kernel time, from the unshaped run
    header = ["layout", "method", *rates] + (["zero bits / entry", "vote kernels ms / step"] if inputs else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for layout in dict.fromkeys(r["layout"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["layout"] == layout):
            points = [
                r for rate in rates for r in rows if (r["layout"], r["method"], r["rate"]) == (layout, method, rate)
            ]
            cells = [f"{r['ratio']:.2f}" for r in points]
            if inputs:
                vote = points[0]["vote_inputs_from_run"]
                cells += [f"{points[0]['zero_bits']:.2f}", f"{points[0]['kernel_s'] * 1e3:.1f}"] if vote else ["-", "-"]
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
        lines.append(f"| {method_label(method)} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def demo_output(reports: list[dict]) -> str:
    """What ``demo`` printed at the end of its run: its table and verdict, as a code block."""
    report = reports[0]
    return "```\n" + summary_text(report["rows"], report["link"], report["counted_by"]) + "\n```"
