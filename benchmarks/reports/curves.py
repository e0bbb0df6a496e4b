"""What a user decides by, from training curves: time and steps to a target loss, across seeds.

A curve is a run's evaluation log: a list of ``{"step", "time_s", "test_loss", ...}`` in step
order. These functions are pure (no training), so the tests check them on synthetic curves.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["mean_std", "seed_summary", "time_to_target"]


def time_to_target(log: list[dict], target: float, key: str = "test_loss") -> tuple[float, int] | None:
    """(wall seconds, step) of the first evaluation whose ``key`` is at or below ``target``;
    None if the run never gets there. The resolution is the evaluation interval (no
    interpolation between evaluations: the claim is only ever what was measured)."""
    if not math.isfinite(target):
        raise ValueError(f"target={target} must be a finite loss")
    for entry in log:
        value = entry[key]
        if math.isfinite(value) and value <= target:
            return entry["time_s"], entry["step"]
    return None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    if not values:
        raise ValueError("mean_std of no values")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def seed_summary(runs: list[dict], target: float | None = None, key: str = "test_loss") -> dict:
    """One method's runs over seeds (each a train result with ``log``, ``step_ms``,
    ``bytes_per_rank``): final ``key``, step time and bytes as (mean, std); per evaluation step
    the mean and std of ``key`` (the band of the plots); and with ``target`` how many seeds reach
    it and the (mean, std) time and steps of those that do."""
    if not runs:
        raise ValueError("seed_summary needs at least one run")
    steps = [e["step"] for e in runs[0]["log"]]
    if any([e["step"] for e in r["log"]] != steps for r in runs):
        raise ValueError("the runs were evaluated at different steps; give every seed the same --steps/--eval-every")
    summary = {
        "seeds": len(runs),
        "final": mean_std([r["log"][-1][key] for r in runs]),
        "step_ms": mean_std([r["step_ms"] for r in runs]),
        "bytes_per_rank": mean_std([r["bytes_per_rank"] for r in runs]),
        "curve": {
            "step": steps,
            "time_s": [statistics.fmean(r["log"][i]["time_s"] for r in runs) for i in range(len(steps))],
            "mean": [mean_std([r["log"][i][key] for r in runs])[0] for i in range(len(steps))],
            "std": [mean_std([r["log"][i][key] for r in runs])[1] for i in range(len(steps))],
        },
    }
    if target is not None:
        reached = [hit for hit in (time_to_target(r["log"], target, key) for r in runs) if hit is not None]
        summary["target"] = target
        summary["reached"] = len(reached)
        summary["time_to_target"] = mean_std([t for t, _ in reached]) if reached else None
        summary["steps_to_target"] = mean_std([float(s) for _, s in reached]) if reached else None
    return summary
