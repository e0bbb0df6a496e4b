"""Choosing a method: per model and link rate, the method with the fastest step (the plan's
model, ``plan --choice``) and the first to DDP+AdamW's loss (that step times the steps measured
training runs took to it), as tables and a picture."""

from __future__ import annotations

import statistics

from signmuon.benchmarks.reports.curves import time_to_target
from signmuon.benchmarks.reports.tables import method_label, train_reports

__all__ = ["CHOICE_NAMES", "MEASURED_AS", "choice_table", "choices", "plot_choice", "steps_factors", "steps_table"]


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
    trains = [next(iter(train_reports([r]))) for r in reports]
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


def choices(reports: list[dict]) -> tuple[list[dict], float, dict]:
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
    cells, _, _ = choices(reports)
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
        lines.append(f"| {CHOICE_NAMES[method]} | {method_label(measured)} | {cell} |")
    return "\n".join(lines)


def plot_choice(reports: list[dict], path: str) -> None:
    """The winner per model and link rate, a panel for each of the two tables."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, target, _ = choices(reports)
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
