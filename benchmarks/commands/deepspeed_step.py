"""DeepSpeed engine step time: its default fp32 gradient all-reduce against the sign vote.

The same ~10M-parameter MLP, the same data, one run: the engine with a plain SGD client
optimizer (DeepSpeed all-reduces the gradients) and with ``SignSGDMV`` / ``SignMuon`` from the
config (all-reduce off, one-bit majority vote overlapped with backward, as the DDP hook does).
``ddp_signsgd_mv`` is the reference the engine should match: plain DDP with ``SignSGDMV``'s hook
on the same model in the same run; ``signsgd_mv_in_step`` votes in ``step()`` after backward
(``initialize(..., overlap_backward=False)``). Reports step time as a ratio to the all-reduce engine and to
that DDP step, and bytes sent per rank per step.

    python -m signmuon.benchmarks deepspeed-step --world-size 2
"""

from __future__ import annotations

import argparse
import os
import statistics

from signmuon.benchmarks.methods.registry import add_methods_option, builder, parse_methods
from signmuon.benchmarks.runtime.cli import command_parser
from signmuon.benchmarks.runtime.launch import run_distributed, timed_calls
from signmuon.comm_hooks.dist import ring_bytes

NAME = "deepspeed-step"
SUMMARY = "the DeepSpeed engine's step: its fp32 all-reduce against the sign vote"


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    # Every method is built first and then timed in interleaved rounds, so drift on a shared
    # machine (and whatever runs first paying the allocator's warm-up) hits all methods alike.
    setups = {method: builder(method, "deepspeed-step")(args) for method in args.methods}
    for step, _, _ in setups.values():
        timed_calls(step, args.warmup)
    sent_before = {m: stats.bytes_sent if stats is not None else 0 for m, (_, stats, _) in setups.items()}
    times: dict[str, list[float]] = {m: [] for m in setups}
    for _ in range(args.steps):
        for method, (step, _, _) in setups.items():
            times[method] += timed_calls(step, 1)
    rows = []
    for method, (_, stats, params) in setups.items():
        if stats is not None:
            per_step = (stats.bytes_sent - sent_before[method]) / args.steps
        else:
            per_step = ring_bytes(params * 4, world_size)  # ring all-reduce of fp32 gradients
        rows.append(
            {"method": method, "params": params, "step_s": statistics.median(times[method]), "bytes_per_rank": per_step}
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("deepspeed-step", __doc__)
    add_methods_option(parser, "deepspeed-step")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parse_methods(parser, argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".cache", "torch_extensions"))
    rows = run_distributed(_worker, args.world_size, args, timeout=1200)[0]
    base = next(r["step_s"] for r in rows if r["method"] == "allreduce") if "allreduce" in args.methods else None
    print(f"DeepSpeed engine, world_size={args.world_size}, params={rows[0]['params'] / 1e6:.1f}M")
    ddp = next((r["step_s"] for r in rows if r["method"] == "ddp_signsgd_mv"), None)
    print(f"{'method':>14} {'step ms':>9} {'vs fp32':>8} {'vs DDP hook':>12} {'MB/rank/step':>13}")
    for r in rows:
        ratio = r["step_s"] / base if base else float("nan")
        vs_ddp = r["step_s"] / ddp if ddp else float("nan")
        print(
            f"{r['method']:>14} {r['step_s'] * 1e3:>9.1f} {ratio:>8.2f} {vs_ddp:>12.2f} {r['bytes_per_rank'] / 1e6:>13.3f}"
        )
    return rows
