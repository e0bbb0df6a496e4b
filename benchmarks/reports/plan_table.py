"""The plan's table: bytes, communication and step time per method on a cluster, the speed-up
over its baseline and the crossover (``signmuon-bench plan``), and how it prints."""

from __future__ import annotations

import math

from signmuon.benchmarks.cost.model import Cluster, Workload, crossover, predict
from signmuon.benchmarks.methods.registry import METHODS

__all__ = ["plan_rows", "print_plan"]


def plan_rows(cluster: Cluster, workload: Workload, methods: list[str]) -> list[dict]:
    """Per method: the model's bytes and times (:func:`~signmuon.benchmarks.cost.model.predict`), its
    baseline, the speed-up over it and the crossover (the link rate above which it stops paying)."""
    rows = []
    for method in methods:
        p = predict(method, cluster, workload)
        base = METHODS[method].plan_baseline
        cross = crossover(method, cluster, workload, base) if method != base else None
        speedup = predict(base, cluster, workload)["step_s"] / p["step_s"]
        rows.append({"method": method, **p, "baseline": base, "speedup": speedup, "crossover_bps": cross})
    return rows


def print_plan(rows: list[dict], cluster: Cluster, workload: Workload) -> None:
    """The plan's table of :func:`plan_rows`, with what its columns assume."""
    print(
        f"{workload.params / 1e6:.1f}M parameters, {cluster.nodes} node(s) x {cluster.ranks_per_node} rank(s), "
        f"link {cluster.link_bps / 1e9:g} Gbit/s per NIC, compute {workload.compute_s * 1e3:.1f} ms/step"
    )
    print(
        f"{'method':>16} {'MB out/node':>12} {'MB in/rank':>11} {'comm ms':>9} {'exposed':>9} {'step ms':>9} "
        f"{'speed-up':>9} {'pays below':>12}"
    )
    for r in rows:
        cross = r["crossover_bps"]
        label = (
            "-"
            if r["method"] == r["baseline"]
            else "always"
            if cross == math.inf
            else "never"
            if cross is None
            else f"{cross / 1e9:.3g} Gbit/s"
        )
        print(
            f"{r['method']:>16} {r['between_bytes_per_node'] / 1e6:>12.2f} {r['inside_bytes_per_rank'] / 1e6:>11.2f} "
            f"{r['comm_s'] * 1e3:>9.2f} {r['exposed_comm_s'] * 1e3:>9.2f} {r['step_s'] * 1e3:>9.2f} "
            f"{r['speedup']:>8.2f}x {label:>12}"
        )
    for base in sorted({r["baseline"] for r in rows} - {"allreduce"}):
        compared = [r["method"] for r in rows if r["baseline"] == base and r["method"] != base]
        print(f"{', '.join(compared)}: speed-up and crossover against {base} ({METHODS[base].summary})")
    if workload.overlap:
        print(
            f"exposed: the communication backward ({workload.backward_share:.2g} of the compute) does not hide, "
            f"{workload.buckets} bucket(s): {workload.first_bucket_bytes / 2**20:g} MB, then "
            f"{workload.bucket_bytes / 2**20:g} MB each (not the node-aware votes' "
            "gather in the node, nor a round); --no-overlap: all of it, the upper bound"
        )
    if any(r["method"].startswith("diloco") for r in rows):
        print(
            f"diloco_*: the node's all-reduce every step and a round every {workload.period} steps (--period), its "
            f"bytes spread over them; one-bit rounds at {workload.round_bits:g} bits per entry (--round-bits). Time "
            "per step only: how many more steps rounds need to reach a loss is not modelled (measure it: train)"
        )
    if workload.sync_delay:
        shares = ", ".join(
            f"{r['method']} {r['round_hidden_share']:.0%}" for r in rows if r["method"].startswith("diloco")
        )
        print(
            f"streaming rounds (F={workload.fragments}, τ={workload.sync_delay}): share of a fragment's round "
            f"hidden behind the next τ steps: {shares}"
        )
