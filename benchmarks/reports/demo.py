"""What ``demo`` decides by and prints: per method the final loss, the time and steps to the
baseline's final loss and the bytes between nodes, a verdict in one line, and on loopback the
plan's projection to a slow link. Pure functions of the runs (and of the measured model inputs),
so the README's copy of the output is made from the demo's JSON report."""

from __future__ import annotations

import dataclasses

from signmuon.benchmarks.cost.model import Cluster, Workload, compute_for, parse_rate, predict
from signmuon.benchmarks.methods.registry import plan_model
from signmuon.benchmarks.reports.curves import time_to_target

__all__ = [
    "LABELS",
    "METHODS",
    "ROUNDS",
    "plan_projection",
    "projection_text",
    "summarize",
    "summary_text",
    "verdict",
]

METHODS = ("adamw", "signmuon_node", "diloco_vote_ef_8")
"""The baseline first: its final loss is the others' target."""
LABELS = {
    "adamw": "DDP+AdamW",
    "signmuon_node": "node-aware SignMuon",
    "diloco_vote_ef_8": "DiLoCo, one-bit rounds every 8 steps",
}


def summarize(runs: dict[str, dict], node_bytes: dict[str, float] | None) -> list[dict]:
    """Per method: final test loss, seconds and steps to the baseline's final loss (None: not
    reached), and bytes that left a node (``node_bytes``, the interfaces' count; else as the
    method's statistics count them per rank)."""
    target = runs[METHODS[0]]["log"][-1]["test_loss"]
    rows = []
    for method, run in runs.items():
        hit = time_to_target(run["log"], target)
        crossed = node_bytes[method] if node_bytes else run["bytes_between_nodes_per_rank"]
        rows.append(
            {
                "method": method,
                "final_loss": run["log"][-1]["test_loss"],
                "target_loss": target,
                "seconds_to_target": None if hit is None else hit[0],
                "steps_to_target": None if hit is None else hit[1],
                "bytes_between_nodes": crossed,
            }
        )
    return rows


def verdict(rows: list[dict], link: str) -> str:
    """One line in plain words: did a one-bit method reach the baseline's loss first?"""
    base, others = rows[0], rows[1:]
    where = f"on a {link} link between 2 nodes" if link != "loopback" else "on loopback (no slow link)"
    reached = [r for r in others if r["seconds_to_target"] is not None]
    if not reached:
        return (
            f"{where.capitalize()}, no one-bit method reached {LABELS[base['method']]}'s final loss "
            f"({base['target_loss']:.3f}) in this run."
        )
    best = min(reached, key=lambda r: r["seconds_to_target"])
    share = base["bytes_between_nodes"] / max(best["bytes_between_nodes"], 1.0)
    pace = _pace(base["seconds_to_target"] / best["seconds_to_target"])
    return (
        f"{where.capitalize()}, {LABELS[best['method']]} reached {LABELS[base['method']]}'s final loss "
        f"({base['target_loss']:.3f}) {pace} ({_seconds(best['seconds_to_target'])} against "
        f"{_seconds(base['seconds_to_target'])}), sending 1/{share:.0f} of its bytes between nodes."
    )


def _pace(ratio: float) -> str:
    """The baseline's time over a method's, in words."""
    return f"{ratio:.1f}x sooner" if ratio >= 1 else f"{1 / ratio:.1f}x later"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def summary_text(rows: list[dict], link: str, counted_by: str) -> str:
    """The demo's table and its verdict, as it prints them."""
    lines = [f"{'method':>38} {'final loss':>11} {'s to target':>12} {'steps':>6} {'MB between nodes':>17}"]
    for r in rows:
        seconds = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        steps = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
        lines.append(
            f"{LABELS[r['method']]:>38} {r['final_loss']:>11.3f} {seconds:>12} {steps:>6} "
            f"{r['bytes_between_nodes'] / 1e6:>17.2f}"
        )
    lines.append(f"(target: {LABELS[rows[0]['method']]}'s final test loss; MB between nodes: {counted_by})")
    lines.append(verdict(rows, link))
    return "\n".join(lines)


ROUNDS = {"period": 8, "round_bits": 1.5}
"""The demo's rounds as the plan models them: every 8 steps, the signs and an fp32 scale per 64
entries (``--outer-scale-block 64``: 1 + 32/64 bits per entry)."""


def plan_projection(
    runs: dict[str, dict], rows: list[dict], inputs: Workload, latency_s: float, link: str, per_node: int = 2
) -> list[dict]:
    """The plan's projection of runs on loopback to ``link`` between their nodes: each method's
    step as :func:`~signmuon.benchmarks.cost.model.predict` gives it there, fed with ``inputs``
    (the model's size and this CPU's kernel throughputs), the compute that the baseline's loopback
    step implies (:func:`~signmuon.benchmarks.cost.model.compute_for`, loopback taken at
    10 Gbit/s), and ``latency_s``;
    times the steps each run took to the target."""
    world = runs[METHODS[0]]["world_size"]

    def cluster(rate: float) -> Cluster:
        return Cluster(world // per_node, per_node, rate, 1, latency_s, 10e9, latency_s)

    workload = dataclasses.replace(inputs, **ROUNDS)
    base = METHODS[0]
    compute = compute_for(plan_model(base), cluster(10e9), workload, runs[base]["step_ms"] / 1e3)
    workload = dataclasses.replace(workload, compute_s=compute)
    projected = []
    for row in rows:
        step = predict(plan_model(row["method"]), cluster(parse_rate(link)), workload)["step_s"]
        steps = row["steps_to_target"]
        projected.append(
            {"method": row["method"], "step_s": step, "seconds_to_target": None if steps is None else steps * step}
        )
    return projected


def projection_text(projected: list[dict], link: str) -> str:
    """The projection's table, labelled as one."""
    lines = [
        f"the plan's projection to a {link} link between the nodes (cost.predict() fed with this run's compute and "
        "this CPU's kernels: a projection, not a measurement)",
        f"{'method':>38} {'step ms':>8} {'s to target':>12}",
    ]
    for p in projected:
        seconds = "-" if p["seconds_to_target"] is None else f"{p['seconds_to_target']:.1f}"
        lines.append(f"{LABELS[p['method']]:>38} {p['step_s'] * 1e3:>8.1f} {seconds:>12}")
    base, reached = projected[0], [p for p in projected[1:] if p["seconds_to_target"] is not None]
    if base["seconds_to_target"] and reached:
        best = min(reached, key=lambda p: p["seconds_to_target"])
        pace = _pace(base["seconds_to_target"] / best["seconds_to_target"])
        lines.append(f"Projected: on a {link} link {LABELS[best['method']]} would reach the target {pace}.")
    return "\n".join(lines)
