"""The cost model against measurements: one row per point from several validation passes."""

from __future__ import annotations

import statistics

__all__ = ["median_rows"]


def median_rows(passes: list[list[dict]]) -> list[dict]:
    """One row per point: the medians over ``passes`` of its predicted and measured step times
    (and of the model's inputs and bytes, where the passes give them), their ratio, and each
    pass's own ratio (``pass_ratios``)."""
    rows = []
    for i, first in enumerate(passes[0]):
        points = [p[i] for p in passes]
        if any(
            (q["layout"], q["method"], q["rate"]) != (first["layout"], first["method"], first["rate"]) for q in points
        ):
            raise ValueError("the validation passes list their points in different orders")
        predicted = statistics.median(q["predicted_s"] for q in points)
        measured = statistics.median(q["measured_s"] for q in points)
        row = {
            "layout": first["layout"],
            "world_size": first["world_size"],
            "method": first["method"],
            "rate": first["rate"],
            "predicted_s": predicted,
            "measured_s": measured,
            "ratio": predicted / measured,
            "pass_ratios": [q["predicted_s"] / q["measured_s"] for q in points],
        }
        for inputs in (
            "bytes_crossing",
            "measured_crossing",
            "compute_s",
            "kernel_bytes_per_s",
            "kernel_s",
            "zero_bits",
            "ns_flops_per_s",
            "latency_s",
        ):
            if all(inputs in q for q in points):
                row[inputs] = statistics.median(q[inputs] for q in points)
        if all("vote_inputs_from_run" in q for q in points):
            row["vote_inputs_from_run"] = all(q["vote_inputs_from_run"] for q in points)
        rows.append(row)
    return rows
