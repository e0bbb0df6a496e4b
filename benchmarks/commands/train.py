"""Data-parallel training benchmark: accuracy, bytes sent per rank and step time per method.

Tasks (see ``workloads/tasks.py``): ``digits`` (scikit-learn's digits, a small CNN), ``charlm`` (a
small GPT on the standard library's source), ``cifar10`` (ResNet-18, from ``--data-dir``).
Each step every rank draws its own slice of the global batch.

    python -m signmuon.benchmarks train --world-size 4 --methods adamw signsgd_mv signum_mv
    torchrun --nproc-per-node 4 -m signmuon.benchmarks train
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics

from signmuon.benchmarks.methods.registry import add_methods_option, names_for, parse_methods
from signmuon.benchmarks.methods.training import STRATEGIES, TrainConfig
from signmuon.benchmarks.methods.tuned import SWEEPS
from signmuon.benchmarks.reports.curves import seed_summary
from signmuon.benchmarks.reports.train_report import (
    by_method,
    print_projection,
    print_summary,
    print_table,
    print_time_split,
    write_curves,
)
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runs.training import run
from signmuon.benchmarks.runtime.cli import add_vote_zeros, check_device, command_parser, network_label, positive_int
from signmuon.benchmarks.runtime.launch import (
    torchrun_group,
    under_torchrun,
)
from signmuon.benchmarks.workloads.tasks import CHARLM_SIZES, TASKS

NAME = "train"
SUMMARY = "the training benchmark (accuracy or perplexity, bytes per rank, step time)"
SHARDED = names_for("train:fsdp")  # the methods --strategy fsdp trains


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("train", __doc__)
    add_methods_option(parser, "train")
    parser.add_argument("--world-size", type=positive_int, default=4, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--task", default="digits", choices=sorted(TASKS))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    parser.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet50"], help="cifar10's model")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--data-dir", help="where cifar10 lives (torchvision's cifar-10-batches-py folder's parent)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[TrainConfig.seed],
        help="one run per seed; several give mean ± std and bands (default: %(default)s)",
    )
    parser.add_argument("--size", default="small", choices=sorted(CHARLM_SIZES), help="charlm's model size")
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="report time and steps to this test loss (default: adamw's final loss, if run)",
    )
    parser.add_argument("--byzantine", type=int, default=0, help="ranks 0..k-1 send flipped signs")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="L for the *_node methods and --strategy fsdp (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    add_vote_zeros(parser)
    parser.add_argument(
        "--strategy",
        default="ddp",
        choices=STRATEGIES,
        help="ddp (replicas) or fsdp (FSDP2 per block: adamw over every rank; "
        f"{', '.join(m for m in SHARDED if m != 'adamw' and not m.startswith('diloco'))} over each node, "
        f"voting between nodes; {', '.join(m for m in SHARDED if m.startswith('diloco'))} over each node, "
        "rounds between nodes)",
    )
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=TrainConfig.outer_lr,
        help="the DiLoCo methods' outer learning rate (default: %(default)s, DiLoCo's)",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=TrainConfig.outer_momentum,
        help="the DiLoCo methods' outer Nesterov momentum (default: %(default)s, DiLoCo's)",
    )
    parser.add_argument(
        "--outer-scale-block",
        type=int,
        default=0,
        help="entries per scale of the one-bit rounds' voted signs (0: one scale per tensor)",
    )
    parser.add_argument(
        "--outer-scale-bits",
        type=int,
        choices=[32, 16, 8],
        default=TrainConfig.outer_scale_bits,
        help="bits those scales travel in: 32 (float32), 16 (bfloat16), 8 (a log-grid code)",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="clip_grad_norm_(max_norm) before each step, as nanoGPT does (default: off)",
    )
    parser.add_argument(
        "--lr-scale",
        type=float,
        default=1.0,
        help="multiply every method's learning rates (default: %(default)s; see the sweep command)",
    )
    parser.add_argument(
        "--untuned",
        dest="tuned_lr",
        action="store_false",
        help="each method's default learning rate instead of the sweep's tuned one (benchmarks/methods/tuned.py)",
    )
    parser.add_argument("--valley", action="store_true", help="measure each final model's Inverse Mean Valley")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--csv", help="write every evaluation (step, time, bytes, losses, accuracy) as CSV")
    parser.add_argument("--plot", help="write test loss vs step / bytes / time as a PNG")
    args = parse_methods(parser, argv)  # before anything trains: a typo must not cost the runs before it
    check_device(parser, args.device)
    if args.task == "cifar10" and not args.data_dir:
        parser.error("--task cifar10 needs --data-dir (the folder holding torchvision's cifar-10-batches-py)")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        parser.error(f"--clip-grad-norm {args.clip_grad_norm} must be > 0")
    if not args.outer_lr > 0 or not 0 <= args.outer_momentum < 1 or args.outer_scale_block < 0:
        parser.error(
            f"--outer-lr {args.outer_lr} must be > 0, --outer-momentum {args.outer_momentum} in [0, 1) "
            f"and --outer-scale-block {args.outer_scale_block} >= 0"
        )
    if not args.lr_scale > 0:
        parser.error(f"--lr-scale {args.lr_scale} must be > 0")
    if args.size != "small" and args.task != "charlm":
        parser.error(f"--size {args.size} is charlm's option; --task {args.task} has one model size")
    if args.target_loss is not None and not math.isfinite(args.target_loss):
        parser.error(f"--target-loss {args.target_loss} must be a finite loss")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.strategy == "fsdp" and set(args.methods) - set(SHARDED):
        parser.error(f"--strategy fsdp trains {sorted(SHARDED)}; not {sorted(set(args.methods) - set(SHARDED))}")
    if args.strategy == "fsdp" and args.ranks_per_node is None and not under_torchrun():
        parser.error("--strategy fsdp shards over each node: pass --ranks-per-node L")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.world_size % args.ranks_per_node):
        parser.error(f"--ranks-per-node {args.ranks_per_node} must be >= 1 and divide --world-size {args.world_size}")
    config = TrainConfig.from_args(args)  # every option of the run's settings
    # Under torchrun one process group serves every run (making it again can hang the rendezvous).
    with torchrun_group() if under_torchrun() else contextlib.nullcontext():
        results = [
            r
            for seed in args.seeds
            for r in run(args.methods, args.world_size, dataclasses.replace(config, seed=seed), valley=args.valley)
        ]
    runs_by_method = by_method(results)
    target = args.target_loss
    if target is None and "adamw" in runs_by_method:  # the quality the full-precision baseline reaches
        target = statistics.fmean(r["log"][-1]["test_loss"] for r in runs_by_method["adamw"])
    summaries = {m: seed_summary(runs, target) for m, runs in runs_by_method.items()}
    if not under_torchrun() or os.environ.get("RANK") == "0":
        if len(args.seeds) == 1:
            print_table(results, target)
            if target is not None and network_label() == "loopback":
                print_projection(results, target)
        else:
            print_summary(summaries, results, target)
        print_time_split(results)
        print(
            "lr x: factor on the method's default learning rate; * = tuned by the learning-rate sweep "
            f"(benchmarks/results/{SWEEPS.get(results[0]['task'].split('-')[0], 'none')}); ~ = its factor for the "
            "same optimizer"
        )
        runs = [{k: v for k, v in r.items() if k != "final_state"} for r in results]
        write_report("train", argv, {"target_loss": target, "summary": summaries, "runs": runs}, args.json)
        write_curves(results, args.csv, args.plot)
    return results
