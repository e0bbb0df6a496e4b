"""DPPF against local SGD: a pull/push grid at each averaging period, over seeds.

DPPF's claim is that pushing the workers apart between rounds lands them in a wider valley and
so generalises better than local SGD at the same communication. This trains local SGD (pull 1,
push 0: every round puts each worker on the average) and DPPF at every (pull, push) of the grid,
each period and seed, all with the same step budget and SGD learning rate, and reports the
consensus model's test loss and accuracy, the workers' own accuracy and their distance from
the average, as mean ± std over seeds. A setting "beats local SGD beyond the seed spread" when
its mean ± std interval lies wholly on the better side of local SGD's.

    signmuon-bench dppf-sweep --task digits --periods 8 32 --pulls 0.5 1 --pushes 0 0.05 0.2 --seeds 0 1 2
"""

from __future__ import annotations

import dataclasses
import math

from signmuon.benchmarks.methods.local_steps import LOCAL_SGD_PULL_PUSH as LOCAL_SGD
from signmuon.benchmarks.methods.training import TrainConfig
from signmuon.benchmarks.reports.curves import mean_std
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runs.training import run
from signmuon.benchmarks.runtime.cli import command_parser, positive_int
from signmuon.benchmarks.workloads.tasks import CHARLM_SIZES, TASKS

NAME = "dppf-sweep"
SUMMARY = "DPPF against local SGD: a pull/push grid per averaging period, over seeds"


__all__ = ["aggregate", "main", "PERIODS"]

PERIODS = (8, 32)  # the periods train has local_sgd_P / dppf_P methods for
METRICS = ("test_loss", "test_acc", "worker_acc", "mean_distance")


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (period, pull, push): each metric's mean ± std over seeds, and against the
    same period's local SGD whether its loss and accuracy are better beyond the spread.

    ``rows``: ``{"period", "pull", "push", "seed", "test_loss", "test_acc", "worker_acc",
    "mean_distance"}``; local SGD is the row with (pull, push) = (1, 0).
    """
    groups: dict[tuple[int, float, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["period"], row["pull"], row["push"]), []).append(row)
    summary = []
    for (period, pull, push), runs in sorted(groups.items()):
        entry = {"period": period, "pull": pull, "push": push, "seeds": len(runs)}
        for metric in METRICS:
            entry[metric] = mean_std([r[metric] for r in runs])
        summary.append(entry)
    for entry in summary:
        base = next(
            (e for e in summary if e["period"] == entry["period"] and (e["pull"], e["push"]) == LOCAL_SGD), None
        )
        if base is None or base is entry:
            entry["loss_beyond_spread"] = entry["acc_beyond_spread"] = None
            continue
        (loss, loss_sd), (base_loss, base_loss_sd) = entry["test_loss"], base["test_loss"]
        (acc, acc_sd), (base_acc, base_acc_sd) = entry["test_acc"], base["test_acc"]
        # +1: better beyond the spread, -1: worse beyond it, 0: the intervals overlap.
        entry["loss_beyond_spread"] = _side(
            base_loss - base_loss_sd, base_loss + base_loss_sd, loss - loss_sd, loss + loss_sd
        )
        # Higher accuracy is better: the same test on negated intervals.
        entry["acc_beyond_spread"] = _side(
            -base_acc - base_acc_sd, -base_acc + base_acc_sd, -acc - acc_sd, -acc + acc_sd
        )
    return summary


def _side(base_low: float, base_high: float, low: float, high: float) -> int:
    """+1 if [low, high] lies below [base_low, base_high], -1 if above or not finite (diverged),
    0 if they overlap."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return -1
    return 1 if high < base_low else -1 if low > base_high else 0


def print_summary(summary: list[dict], task: str, world_size: int, steps: int) -> None:
    print(
        f"DPPF vs local SGD: task={task}, world_size={world_size}, steps={steps}; consensus model, mean ± std over seeds"
    )
    print(
        f"{'period':>6} {'pull':>5} {'push':>6} {'test loss':>17} {'test acc':>17} {'worker acc':>17} {'distance':>15}  vs local SGD"
    )
    verdict = {1: "better", -1: "worse", 0: "within spread", None: ""}
    for e in summary:
        cells = [f"{e[m][0]:.4f} ± {e[m][1]:.4f}" for m in METRICS]
        name = (
            "local SGD"
            if (e["pull"], e["push"]) == LOCAL_SGD
            else (f"loss {verdict[e['loss_beyond_spread']]}, acc {verdict[e['acc_beyond_spread']]}")
        )
        print(
            f"{e['period']:>6} {e['pull']:>5g} {e['push']:>6g} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} {cells[3]:>15}  {name}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = command_parser("dppf-sweep", __doc__)
    parser.add_argument("--task", default="digits", choices=sorted(TASKS), help="(default: %(default)s)")
    parser.add_argument(
        "--size", default="small", choices=sorted(CHARLM_SIZES), help="charlm's model size (default: %(default)s)"
    )
    parser.add_argument(
        "--periods", nargs="+", type=int, choices=PERIODS, default=list(PERIODS), help="(default: %(default)s)"
    )
    parser.add_argument("--pulls", nargs="+", type=float, default=[0.5, 1.0], help="(default: %(default)s)")
    parser.add_argument("--pushes", nargs="+", type=float, default=[0.0, 0.05, 0.2], help="(default: %(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(default: %(default)s)")
    parser.add_argument("--world-size", type=positive_int, default=4, help="(default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=320, help="(default: %(default)s)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=TrainConfig.batch_size, help="(default: %(default)s)"
    )
    parser.add_argument("--json", help="write the runs, the summary and the command line here")
    args = parser.parse_args(argv)
    if any(not 0.0 <= p <= 1.0 for p in args.pulls):
        parser.error(f"--pulls {args.pulls}: each must lie in [0, 1] (the fraction of the way to the average)")
    if any(not (q >= 0.0 and math.isfinite(q)) for q in args.pushes):
        parser.error(f"--pushes {args.pushes}: each must be finite and >= 0")
    if args.size != "small" and args.task != "charlm":
        parser.error(f"--size {args.size} is charlm's option")
    if args.batch_size % args.world_size:
        parser.error(f"--batch-size {args.batch_size} must divide by --world-size {args.world_size}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    grid = [(pull, push) for pull in args.pulls for push in args.pushes if (pull, push) != LOCAL_SGD]
    rows = []
    for period in args.periods:
        for seed in args.seeds:
            base = TrainConfig.from_args(args, eval_every=args.steps, seed=seed)  # task, size, steps, batch
            settings = [(LOCAL_SGD, f"local_sgd_{period}", base)] + [
                ((pull, push), f"dppf_{period}", dataclasses.replace(base, pull_push=(pull, push)))
                for pull, push in grid
            ]
            for (pull, push), method, config in settings:
                result = run([method], args.world_size, config)[0]
                rows.append(
                    {
                        "period": period,
                        "pull": pull,
                        "push": push,
                        "seed": seed,
                        "test_loss": result["log"][-1]["test_loss"],
                        "test_acc": result["test_acc"],
                        "worker_acc": result["worker_acc"],
                        "mean_distance": result["mean_distance"],
                        "rounds": result["rounds"],
                    }
                )
    summary = aggregate(rows)
    print_summary(
        summary, args.task if args.size == "small" else f"{args.task}-{args.size}", args.world_size, args.steps
    )
    fields = {
        "task": args.task,
        "size": args.size,
        "world_size": args.world_size,
        "steps": args.steps,
        "runs": rows,
        "summary": summary,
    }
    return write_report("dppf-sweep", argv, fields, args.json)
