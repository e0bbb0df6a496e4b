"""Tuned learning rates: the factor on each method's default learning rate that the sweep chose.

``signmuon-bench sweep`` trained every method at several factors, 3 seeds each (PowerSGD: seed 0), 300 steps on 4
ranks; the factor with the lowest mean final validation loss is kept here, per task (the JSON
files in benchmarks/results/ hold the whole grid and the command lines). ``train`` applies these
factors unless ``--untuned``; a method or task without an entry runs at its default (factor 1)
and its table row says so.
"""

from __future__ import annotations

from signmuon.benchmarks.methods.registry import METHODS

__all__ = ["SWEEPS", "TUNED_LR_SCALES", "borrowed_lr_scale", "tuned_lr_scale"]

# task -> method -> factor (charlm: the small GPT; other sizes are not swept)
TUNED_LR_SCALES: dict[str, dict[str, float]] = {
    "charlm": {
        "adamw": 4.0,  # 1.983 ± 0.036 (x2 2.049, x8 2.000)
        "muon_adamw": 2.0,  # 1.896 ± 0.021 (x1 1.973, x4 2.002)
        "powersgd_adamw": 4.0,  # seed 0 only: 2.142 (x2 2.181, x8 2.169; x1 2.278 in 12-03-rates)
        "powersgd_adamw_r1": 2.0,  # seed 0 only: 2.391 (x1 2.408, x4 2.440, x8 2.419)
        "powersgd_adamw_r2": 2.0,  # seed 0 only: 2.282 (x1 2.347, x4 2.293, x8 2.317)
        "signmuon": 4.0,  # 1.889 ± 0.010 (x2 1.891, x8 2.020)
        "signmuon_fan_in": 1.0,  # 2.052 ± 0.039 (x0.5 2.139, x2 2.158)
        "signum_mv": 4.0,  # 2.035 ± 0.020 (x2 2.060, x8 2.122)
        "signsgd_mv": 8.0,  # 2.246 ± 0.031 (x4 2.289, x16 2.294)
    },
    "digits": {
        "adamw": 2.0,  # 0.057 ± 0.012, accuracy 0.982 ± 0.011
        "muon_adamw": 0.5,  # 0.060 ± 0.012, accuracy 0.979 ± 0.002
        "signmuon": 0.5,  # 0.050 ± 0.019, accuracy 0.988 ± 0.003
        "signum_mv": 1.0,  # 0.085 ± 0.016, accuracy 0.974 ± 0.009
        "signsgd_mv": 2.0,  # 0.151 ± 0.006, accuracy 0.959 ± 0.011
    },
}
SWEEPS = {
    "charlm": ", ".join(
        ["2026-12-03-sweep-charlm.json", "2026-12-03-sweep-charlm-wider.json"]
        + [
            f"2026-12-07-powersgd-sweep-charlm-r{r}-x{x}.json"
            for r in (1, 2, 4)
            for x in (1, 2, 4, 8)
            if (r, x) != (4, 1)  # rank 4 at x1 is its default run, in 2026-12-03-rates-charlm.json
        ]
    ),
    "digits": "2026-12-03-sweep-digits.json",
}


def tuned_lr_scale(task: str, method: str) -> float | None:
    """The sweep's factor for ``method`` on ``task``, or None where it was not swept."""
    return TUNED_LR_SCALES.get(task, {}).get(method)


def borrowed_lr_scale(task: str, method: str) -> float | None:
    """The factor swept for the optimizer ``method`` shares (the registry's ``tuned_as``), or None."""
    shared = METHODS[method].tuned_as if method in METHODS else None
    return tuned_lr_scale(task, shared) if shared else None
