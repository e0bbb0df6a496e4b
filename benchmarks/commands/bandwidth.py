"""Collective bandwidth: message sizes x gradient-reduction methods, as nccl-tests reports it.

For each size (entries of an fp32 gradient) and method: ``--warmup`` untimed calls, then
``--iters`` timed ones; each call's time is the max over ranks (a collective is as slow as
its slowest rank); we report median / p10 / p90, the algorithmic bytes one rank sends, algbw
(fp32 message bytes / time) and busbw (algbw * 2(M-1)/M, nccl-tests' all-reduce convention,
so every method is compared against moving the full fp32 gradient), and the speed-up over
the fp32 all-reduce of the same size measured in the same run.

    signmuon-bench bandwidth --world-size 4 --sizes 1K 64K 1M 16M
    torchrun --nnodes 2 --nproc-per-node 8 -m signmuon.benchmarks bandwidth --sizes 1M 256M
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics

import torch

from signmuon.benchmarks.methods.registry import add_methods_option, builder, parse_methods
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import command_parser, positive_int, size
from signmuon.benchmarks.runtime.launch import (
    run_distributed,
    run_torchrun,
    timed_calls,
    under_torchrun,
)

NAME = "bandwidth"
SUMMARY = "message sizes x reduction methods: time, bytes per rank, algbw/busbw, speed-up"


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    progress = None
    total = len(args.sizes) * len(args.methods)
    if rank == 0 and args.progress:
        try:
            from tqdm import tqdm

            progress = tqdm(total=total, desc="bandwidth", leave=False)
        except ImportError:
            progress = None
    rows = []
    for numel in args.sizes:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        for method in args.methods:
            try:
                call, sent = builder(method, "bandwidth")(grad, world_size)
                for _ in range(args.warmup):
                    call()
                times = sorted(timed_calls(call, args.iters))
                median = statistics.median(times)
                row = {
                    "method": method,
                    "numel": numel,
                    "world_size": world_size,
                    "bytes_per_rank": sent,
                    "median_s": median,
                    "p10_s": times[int(0.1 * (len(times) - 1))],
                    "p90_s": times[int(math.ceil(0.9 * (len(times) - 1)))],
                    "algbw_GBps": 4 * numel / median / 1e9,
                    "busbw_GBps": 4 * numel / median / 1e9 * 2 * (world_size - 1) / world_size,
                }
            except RuntimeError as error:  # e.g. a dtype the backend does not reduce
                row = {
                    "method": method,
                    "numel": numel,
                    "world_size": world_size,
                    "error": str(error).splitlines()[0][:120],
                }
            rows.append(row)
            if progress is not None:
                progress.update()
    if progress is not None:
        progress.close()
    for row in rows:
        base = next((r for r in rows if r["numel"] == row["numel"] and r["method"] == "allreduce"), None)
        if base is not None and "error" not in row and "error" not in base:
            row["speedup_vs_fp32"] = base["median_s"] / row["median_s"]
            row["bytes_vs_fp32"] = row["bytes_per_rank"] / base["bytes_per_rank"]
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"world_size={rows[0]['world_size']} backend={args.backend_name} torch={torch.__version__}")
    print(
        f"{'entries':>10} {'method':>18} {'median ms':>10} {'p10':>8} {'p90':>8} {'KB/rank':>10} {'algbw GB/s':>10} "
        f"{'busbw':>8} {'speedup':>8}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['numel']:>10} {r['method']:>18}  unsupported: {r['error']}")
            continue
        print(
            f"{r['numel']:>10} {r['method']:>18} {r['median_s'] * 1e3:>10.3f} {r['p10_s'] * 1e3:>8.3f} "
            f"{r['p90_s'] * 1e3:>8.3f} {r['bytes_per_rank'] / 1e3:>10.1f} {r['algbw_GBps']:>10.3f} "
            f"{r['busbw_GBps']:>8.3f} {r.get('speedup_vs_fp32', float('nan')):>8.2f}"
        )
    write_report("bandwidth", args.argv, {"rows": rows}, args.json)
    if args.csv:
        fields = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """Time vs message size, log-log, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["numel"], r["median_s"] * 1e3) for r in rows if r["method"] == method and "error" not in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gradient entries (fp32)")
    ax.set_ylabel("time per call, ms (max over ranks, median)")
    ax.set_title(f"gradient reduction, {rows[0]['world_size']} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("bandwidth", __doc__)
    add_methods_option(parser, "bandwidth")
    parser.add_argument("--world-size", type=positive_int, default=4, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--sizes", nargs="+", type=size, default=["1K", "16K", "256K", "4M", "16M"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    parser.add_argument("--plot", help="write a PNG plot (needs matplotlib: the bench extra)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parse_methods(parser, argv)
    args.argv = argv  # the report's command line
    if under_torchrun():
        rows = run_torchrun(_worker, args)
        args.backend_name = "torchrun"
        if os.environ["RANK"] == "0":
            report(rows, args)
        return rows
    args.backend_name = "gloo"
    rows = run_distributed(_worker, args.world_size, args, timeout=3600)[0]
    report(rows, args)
    return rows
