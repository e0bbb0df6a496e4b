"""The cost model against measurements: the time bytes take through ``netem``'s shaped links,
and one row per point from several validation passes."""

from __future__ import annotations

import math
import statistics

from signmuon.benchmarks.cost.model import parse_rate

__all__ = ["median_rows", "wire_seconds"]


def wire_seconds(nbytes: float, rate: str, idle_s: float = math.inf) -> float:
    """Seconds ``nbytes`` take through one of ``netem``'s shaped links: its token bucket (10 ms
    of traffic, at least 32 KiB) refills at the link's rate while the link is idle, ``idle_s``
    a step (about the step's compute), and lets what it holds through at once."""
    bps = parse_rate(rate)
    burst = min(max(bps / 8 / 100, 32 * 1024), bps / 8 * idle_s)
    return 8 * max(0.0, nbytes - burst) / bps


def median_rows(passes: list[list[dict]]) -> list[dict]:
    """One row per point: the medians over ``passes`` of its predicted and measured step times
    (and of the model's inputs, bytes crossing and base step), their ratio, and each pass's own
    ratio (``pass_ratios``)."""
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
        for inputs in ("bytes_crossing", "base_s"):  # the model's inputs, where the passes give them
            if all(inputs in q for q in points):
                row[inputs] = statistics.median(q[inputs] for q in points)
        rows.append(row)
    return rows
