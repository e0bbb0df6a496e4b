"""DDP step time of a ~10M-parameter MLP with different gradient reductions.

Compares no hook (DDP's fp32 all-reduce), torch's ``fp16_compress_hook`` and PowerSGD (on gloo
one bucket at a time: torch's hook issues collectives from future callbacks, which gloo would
pair out of order across ranks; ``methods.hooks.serial_powersgd_hook``; its bytes by the formula of P
and Q per bucket), and
our hooks (signSGD-MV, Signum-MV, SignMuon; ``*_node``: the node-aware vote, full precision
inside a node and one bit between nodes), all in one run, as ratios to the fp32 all-reduce
step; and sharded models (``fsdp_*``): FSDP2 over every rank with SGD (the fp32
reduce-scatter baseline), or FSDP2 inside each node with the vote between nodes
(``register_fsdp_vote``). "state MB/rank" is the optimizer's and the hook's state each rank holds (Signum's momentum: a
bucket's whole on the flat vote, its 1/L slice on the node-aware one). Bytes per rank per step come from the hooks' own statistics or the ring all-reduce
formula; "bits/entry" is 8 x bytes / (parameters x 2(M-1)/M), the bandwidth-optimal
all-reduce's cost per entry (32 for fp32, 1 for an ideal 1-bit vote). Each step draws one of
four batches, so ReLU's dead units differ from step to step as in training.

    python -m signmuon.benchmarks ddp-step --world-size 2          # local gloo ranks
    torchrun --nproc-per-node 8 -m signmuon.benchmarks ddp-step    # a real cluster
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch import nn

from signmuon.benchmarks.methods.registry import add_methods_option, builder, parse_methods
from signmuon.benchmarks.methods.training import fsdp_traffic
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import add_vote_zeros, command_parser, positive_int
from signmuon.benchmarks.runtime.launch import (
    run_distributed,
    run_torchrun,
    timed_calls,
    torchrun_group,
    under_torchrun,
)
from signmuon.comm_hooks.dist import all_reduce, group_device, ring_bytes

NAME = "ddp-step"
SUMMARY = "DDP step time of a ~10M-parameter MLP: fp32 all-reduce, fp16, PowerSGD, sign vote"


def _state_bytes(opt: torch.optim.Optimizer, hook_state) -> int:
    """Bytes of optimizer and hook state this rank holds (its shards of sharded state)."""
    local = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    local += list(getattr(hook_state, "momentum_buffers", {}).values())
    return sum(v.numel() * v.element_size() for v in local if torch.is_tensor(v) and v.dim() > 0)


def _kernel_seconds(stats) -> float:
    """Host seconds the vote spent encoding, voting and decoding (``CommStats``), waits excluded."""
    return stats.pack_seconds + stats.vote_seconds + stats.unpack_seconds


def _worker(rank: int, world_size: int, args: argparse.Namespace, methods: list[str]) -> list[dict]:
    device = group_device(None)
    rows = []
    for method in methods:
        torch.manual_seed(0)
        setup = builder(method, "ddp-step")(args, device)
        model, opt, state, shard_ranks = setup.model, setup.optimizer, setup.state, setup.shard_ranks
        gen = torch.Generator().manual_seed(rank)
        batches = [
            (
                torch.randn(args.batch, 512, generator=gen).to(device),
                torch.randint(0, 10, (args.batch,), generator=gen).to(device),
            )
            for _ in range(4)
        ]
        counter = [0]
        hooked = hasattr(state, "stats")
        in_backward = [0]  # bytes between nodes sent inside loss.backward()

        def step():
            x, y = batches[counter[0] % len(batches)]
            counter[0] += 1
            opt.zero_grad(set_to_none=True)
            sent = state.stats.bytes_sent_between_nodes if hooked else 0
            nn.functional.cross_entropy(model(x), y).backward()
            in_backward[0] += state.stats.bytes_sent_between_nodes - sent if hooked else 0
            opt.step()

        timed_calls(step, args.warmup, device)
        in_backward[0] = 0
        sent_before = state.stats.bytes_sent if hooked else 0
        kernels_before = _kernel_seconds(state.stats) if hooked else 0.0
        between_before = state.stats.bytes_sent_between_nodes if hooked else 0
        times = timed_calls(step, args.steps, device)
        params = sum(p.numel() for p in model.parameters())
        if shard_ranks is not None:  # FSDP2's own collectives by formula, plus the vote as measured
            per_step = fsdp_traffic(params, shard_ranks) + (
                (state.stats.bytes_sent - sent_before) / args.steps if hooked else 0
            )
        elif hooked:
            per_step = (state.stats.bytes_sent - sent_before) / args.steps  # measured by the hook
        else:
            per_step = ring_bytes(params * setup.bytes_per_entry, world_size)
        optimal = params * 2 * (world_size - 1) / world_size  # entries' worth of an optimal all-reduce
        bits = 8 * per_step / optimal if world_size > 1 else float("nan")
        row = {
            "method": method,
            "params": params,
            "step_s": statistics.median(times),
            "bytes_per_rank": per_step,
            "bits_per_entry": bits,
            "state_bytes": _state_bytes(opt, state),
        }
        if hooked:  # the vote's own work per step on this rank's gradients (zeros included), not a microbenchmark's
            row["vote_kernel_s"] = (_kernel_seconds(state.stats) - kernels_before) / args.steps
        if setup.node_layout is not None:
            nodes, per_node, node_group = setup.node_layout()
            row["nodes"] = f"{nodes}x{per_node}"
            row["between_nodes_bytes_per_rank"] = (state.stats.bytes_sent_between_nodes - between_before) / args.steps
            # The share a backward pass can hide: bytes between nodes issued inside loss.backward().
            sent_between = state.stats.bytes_sent_between_nodes - between_before
            row["between_nodes_in_backward_share"] = in_backward[0] / sent_between if sent_between else 0.0
            # A node's ranks carry different shares (SignMuon's owners): the node's sums, every
            # call counted (what the veth counters see) and per timed step.
            between = state.stats.bytes_sent_between_nodes
            total = torch.tensor(
                [float(between), (between - between_before) / args.steps], dtype=torch.float64, device=device
            )
            if node_group is not None and per_node > 1:
                all_reduce(total, node_group)
            row["between_nodes_bytes_per_node_all_calls"] = total[0].item()
            row["between_nodes_bytes_per_node"] = total[1].item()
        rows.append(row)
    return rows


def report(rows: list[dict], world_size: int) -> None:
    base = next((r["step_s"] for r in rows if r["method"] == "allreduce" and "error" not in r), None)
    params = next((r["params"] for r in rows if "params" in r), 0)
    nodes = next((r["nodes"] for r in rows if "nodes" in r), None)
    print(
        f"world_size={world_size} params={params / 1e6:.1f}M torch={torch.__version__}"
        + (f" nodes={nodes} (node-aware rows: MB/rank/step counts inside + between nodes)" if nodes else "")
    )
    print(f"{'method':>19} {'step ms':>9} {'vs fp32':>8} {'MB/rank/step':>13} {'bits/entry':>11} {'state MB/rank':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:>19}  failed: {r['error']}")
            continue
        ratio = r["step_s"] / base if base else float("nan")
        rounds = "  rounds " + " ".join(f"{t * 1e3:.1f}" for t in r["step_s_rounds"]) if "step_s_rounds" in r else ""
        between = (
            f"  between nodes {r['between_nodes_bytes_per_rank'] / 1e6:.2f} MB"
            f" ({r['between_nodes_in_backward_share']:.0%} in backward)"
            if "nodes" in r
            else ""
        )
        print(
            f"{r['method']:>19} {r['step_s'] * 1e3:>9.1f} {ratio:>8.2f} {r['bytes_per_rank'] / 1e6:>13.2f} "
            f"{r['bits_per_entry']:>11.2f} {r['state_bytes'] / 1e6:>14.2f}{between}{rounds}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("ddp-step", __doc__)
    add_methods_option(parser, "ddp-step")
    parser.add_argument("--world-size", type=positive_int, default=2, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers; 1728x4 is about 9.9M parameters")
    parser.add_argument("--batch", type=int, default=8, help="small, so the step is communication-bound")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows to this file")
    add_vote_zeros(parser)
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="L for the *_node and fsdp_* methods (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every method this many times, interleaved; each step time is the median",
    )
    args = parse_methods(parser, argv)
    if under_torchrun():
        with torchrun_group():  # one group for every round: making it again can hang the rendezvous
            rows = merge_rounds([run_torchrun(_worker, args, args.methods) for _ in range(args.rounds)])
        if os.environ["RANK"] == "0":
            report(rows, int(os.environ["WORLD_SIZE"]))
            write_report("ddp-step", argv, {"rows": rows}, args.json)
        return rows
    passes = []
    for _ in range(args.rounds):
        rows = []
        for method in args.methods:  # one process group per method: a crash costs only its own row
            try:
                rows += run_distributed(_worker, args.world_size, args, [method], threads=args.threads)[0]
            except Exception as error:  # noqa: BLE001 - reported in the table
                rows.append({"method": method, "error": str(error).strip().splitlines()[-1][:160]})
        passes.append(rows)
    rows = merge_rounds(passes)
    report(rows, args.world_size)
    write_report("ddp-step", argv, {"rows": rows}, args.json)
    return rows


def merge_rounds(passes: list[list[dict]]) -> list[dict]:
    """One row per method from interleaved ``passes`` (each a list of rows, methods in the same
    order): the last pass's row with the median step time, each pass's in ``step_s_rounds``.
    A method that failed in any pass keeps that pass's error."""
    rows = []
    for i, last in enumerate(passes[-1]):
        mine = [p[i] for p in passes]
        if any(r["method"] != last["method"] for r in mine):
            raise ValueError("the passes list their methods in different orders")
        failed = next((r for r in mine if "error" in r), None)
        if failed is not None or len(passes) == 1:
            rows.append(failed or last)
            continue
        times = [r["step_s"] for r in mine]
        rows.append({**last, "step_s": statistics.median(times), "step_s_rounds": times})
    return rows
