"""What ``demo`` decides by and prints: per method the final loss, the time and steps to the
baseline's final loss and the bytes between nodes, and a verdict in one line. Pure functions
of the runs, so the README's copy of the output is made from the demo's JSON report."""

from __future__ import annotations

from signmuon.benchmarks.reports.curves import time_to_target

__all__ = ["LABELS", "METHODS", "summarize", "summary_text", "verdict"]

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
    ratio = base["seconds_to_target"] / best["seconds_to_target"]
    share = base["bytes_between_nodes"] / max(best["bytes_between_nodes"], 1.0)
    pace = f"{ratio:.1f}x sooner" if ratio >= 1 else f"{1 / ratio:.1f}x later"
    return (
        f"{where.capitalize()}, {LABELS[best['method']]} reached {LABELS[base['method']]}'s final loss "
        f"({base['target_loss']:.3f}) {pace} ({best['seconds_to_target']:.0f} s against "
        f"{base['seconds_to_target']:.0f} s), sending 1/{share:.0f} of its bytes between nodes."
    )


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
