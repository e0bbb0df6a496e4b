"""Learning-rate sweep: each method at a few multiples of its default learning rate, over seeds.

A comparison is only as fair as its worst-tuned baseline. For every method and every factor in
``--lr-scales`` (all of the method's learning rates multiplied by it) this trains every seed and
reports the final validation loss as mean ± std; the tuned factor of a method is the one with
the lowest mean. The JSON keeps the whole grid and the command line.

    signmuon-bench sweep --task charlm --methods adamw muon_adamw signmuon --lr-scales 0.25 0.5 1 2 4 --seeds 0 1 2
"""

from __future__ import annotations

import math
import statistics

from signmuon.benchmarks.methods.registry import add_methods_option, parse_methods
from signmuon.benchmarks.methods.training import TrainConfig
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runs.training import run
from signmuon.benchmarks.runtime.cli import command_parser, positive_int
from signmuon.benchmarks.workloads.tasks import TASKS

NAME = "sweep"
SUMMARY = "learning-rate sweep: methods x lr factors x seeds, the tuned factor per method"


__all__ = ["aggregate", "main"]


def aggregate(grid: list[dict]) -> dict[str, dict]:
    """Per method: every factor's mean ± std of the final validation loss over seeds, and the
    tuned factor (lowest mean; ties to the smaller factor).

    ``grid`` rows: ``{"method", "lr_scale", "seed", "test_loss", ...}``.
    """
    by_method: dict[str, dict[float, list[float]]] = {}
    for row in grid:
        by_method.setdefault(row["method"], {}).setdefault(row["lr_scale"], []).append(row["test_loss"])
    summary = {}
    for method, by_scale in by_method.items():
        scales = {
            scale: {
                "mean": statistics.fmean(losses),
                "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "seeds": len(losses),
            }
            for scale, losses in sorted(by_scale.items())
        }
        finite = {s: v for s, v in scales.items() if math.isfinite(v["mean"])}
        best = min(finite, key=lambda s: (finite[s]["mean"], s)) if finite else None
        summary[method] = {"scales": scales, "tuned_scale": best, "tuned": scales[best] if best is not None else None}
    return summary


def print_summary(summary: dict[str, dict], task: str, world_size: int, steps: int) -> None:
    print(
        f"learning-rate sweep: task={task}, world_size={world_size}, steps={steps}; final validation loss, mean ± std"
    )
    scales = sorted({s for v in summary.values() for s in v["scales"]})
    print(f"{'method':>18} " + " ".join(f"{'x' + format(s, 'g'):>15}" for s in scales) + f" {'tuned':>7}")
    for method, v in summary.items():
        cells = []
        for s in scales:
            cell = v["scales"].get(s)
            cells.append(f"{cell['mean']:>7.4f} ± {cell['std']:.4f}" if cell else f"{'-':>15}")
        tuned = "-" if v["tuned_scale"] is None else "x" + format(v["tuned_scale"], "g")
        print(f"{method:>18} " + " ".join(f"{c:>15}" for c in cells) + f" {tuned:>7}")


def main(argv: list[str] | None = None) -> dict:
    parser = command_parser("sweep", __doc__)
    add_methods_option(parser, "train", ["adamw", "signum_mv", "signmuon"])
    parser.add_argument("--task", default="digits", choices=sorted(TASKS), help="(default: %(default)s)")
    parser.add_argument(
        "--lr-scales", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0, 4.0], help="(default: %(default)s)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(default: %(default)s)")
    parser.add_argument("--world-size", type=positive_int, default=4, help="(default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=TrainConfig.steps, help="(default: %(default)s)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=TrainConfig.batch_size, help="(default: %(default)s)"
    )
    parser.add_argument("--json", help="write the grid, the summary and the command line here")
    args = parse_methods(parser, argv)
    if any(not (s > 0 and math.isfinite(s)) for s in args.lr_scales):
        parser.error(f"--lr-scales {args.lr_scales}: each must be a positive number")
    if args.batch_size % args.world_size:
        parser.error(f"--batch-size {args.batch_size} must divide by --world-size {args.world_size}")
    grid = []
    for scale in args.lr_scales:
        for seed in args.seeds:
            # Factors on each method's default learning rate, not on an earlier sweep's choice.
            config = TrainConfig.from_args(args, eval_every=args.steps, seed=seed, lr_scale=scale, tuned_lr=False)
            for result in run(args.methods, args.world_size, config):
                final = result["log"][-1]
                grid.append(
                    {
                        "method": result["method"],
                        "lr_scale": scale,
                        "seed": seed,
                        "test_loss": final["test_loss"],
                        "test_acc": final["test_acc"],
                        "step_ms": result["step_ms"],
                    }
                )
    summary = aggregate(grid)
    print_summary(summary, args.task, args.world_size, args.steps)
    fields = {
        "task": args.task,
        "world_size": args.world_size,
        "steps": args.steps,
        "grid": grid,
        "summary": {m: {**v, "scales": {str(s): c for s, c in v["scales"].items()}} for m, v in summary.items()},
    }
    return write_report("sweep", argv, fields, args.json)
