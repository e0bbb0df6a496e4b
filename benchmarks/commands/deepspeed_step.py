"""DeepSpeed engine step time: its default fp32 gradient all-reduce against the sign vote.

The same ~10M-parameter MLP, the same data, one run: the engine with a plain SGD client
optimizer (DeepSpeed all-reduces the gradients) and with ``SignSGDMV`` / ``SignMuon`` from the
config (all-reduce off, one-bit majority vote overlapped with backward, as the DDP hook does).
``ddp_signsgd_mv`` is the reference the engine should match: plain DDP with ``SignSGDMV``'s hook
on the same model in the same run; ``signsgd_mv_in_step`` votes in ``step()`` after backward
(``initialize(..., overlap_backward=False)``). Reports step time as a ratio to the all-reduce engine and to
that DDP step, and bytes sent per rank per step.

ZeRO rows (``zero1_*``, ``zero2_*``: ZeRO inside each node, the vote between nodes) against
``zero2_adamw`` (DeepSpeed's own ZeRO-2 over every rank) run on emulated nodes, where each node's
interface counters give the bytes between nodes of each method's steps::

    signmuon-bench netem --world-size 4 --ranks-per-node 2 --rates 100mbit 1gbit -- deepspeed-step \\
        --methods zero2_adamw zero1_signum_mv zero2_signum_mv zero2_signmuon --width 1024 --depth 2

    python -m signmuon.benchmarks deepspeed-step --world-size 2
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from signmuon.benchmarks.methods.registry import add_methods_option, builder, parse_methods
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import command_parser
from signmuon.benchmarks.runtime.launch import run_distributed, run_torchrun, timed_calls, under_torchrun
from signmuon.comm_hooks.dist import all_reduce, ring_bytes

NAME = "deepspeed-step"
SUMMARY = "the DeepSpeed engine's step: its fp32 all-reduce against the sign vote"
DEFAULT_METHODS = ["allreduce", "signsgd_mv", "signmuon", "signsgd_mv_in_step", "ddp_signsgd_mv"]
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12: the counters' bytes per packet beyond payload


def _node_counters() -> torch.Tensor:
    """This node's interface (bytes, packets) sent so far, on its first rank under ``netem``; else zeros."""
    if "SIGNMUON_NETEM_RATE" not in os.environ or os.environ.get("LOCAL_RANK") != "0":
        return torch.zeros(2, dtype=torch.float64)
    read = [open(f"/sys/class/net/eth0/statistics/{name}").read() for name in ("tx_bytes", "tx_packets")]
    return torch.tensor([float(v) for v in read], dtype=torch.float64)


def _state_bytes(opt) -> int:
    tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(v.numel() * v.element_size() for v in tensors)


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    # Every method is built first and then timed in interleaved rounds, so drift on a shared
    # machine (and whatever runs first paying the allocator's warm-up) hits all methods alike.
    setups = {method: builder(method, "deepspeed-step")(args) for method in args.methods}
    for step, *_ in setups.values():
        timed_calls(step, args.warmup)
    sent_before = {m: s[1].bytes_sent if s[1] is not None else 0 for m, s in setups.items()}
    times: dict[str, list[float]] = {m: [] for m in setups}
    counted = {m: torch.zeros(2, dtype=torch.float64) for m in [*setups, "barrier_only"]}
    for _ in range(args.steps):
        for method, (step, *_) in [*setups.items(), ("barrier_only", (lambda: None,))]:
            before = _node_counters()
            elapsed = timed_calls(step, 1)  # a barrier, the step, an all-reduce of its time: all its bytes are out
            counted[method] += _node_counters() - before
            if method in times:
                times[method] += elapsed
    # Per node: its first rank read the counters; the sum over the world puts each node in its slot.
    nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    table = torch.zeros(len(counted), nodes, 2, dtype=torch.float64)
    for i, m in enumerate(counted):
        table[i, rank * nodes // world_size] = counted[m] / args.steps
    all_reduce(table, None)
    rows = []
    for i, (method, (_, stats, params, stateful)) in enumerate(setups.items()):
        if stats is not None:
            per_step = (stats.bytes_sent - sent_before[method]) / args.steps
        else:
            per_step = ring_bytes(params * 4, world_size)  # ring all-reduce of fp32 gradients
        row = {
            "method": method,
            "params": params,
            "step_s": statistics.median(times[method]),
            "bytes_per_rank": per_step,
        }
        row["step_s_all"] = times[method]
        if stateful is not None:
            state = torch.tensor([float(_state_bytes(stateful))], dtype=torch.float64)
            row["state_bytes_per_rank"] = state.item()
            all_reduce(state, None, op="max")
            row["state_bytes_max_rank"] = state.item()
        if "SIGNMUON_NETEM_RATE" in os.environ:
            # Between nodes per step, the timing barrier's own bytes taken off; payload: less the headers.
            extra = table[i] - table[-1]
            row["interface_bytes_per_node"] = extra[:, 0].tolist()
            row["interface_payload_bytes_per_node"] = (extra[:, 0] - HEADER_BYTES * extra[:, 1]).tolist()
        if stats is not None:
            total = torch.tensor([per_step], dtype=torch.float64)
            all_reduce(total, None)
            row["counted_bytes_per_node"] = total.item() / nodes  # what the optimizers counted, the node's ranks summed
        rows.append(row)
    return rows


def report(rows: list[dict], world_size: int) -> None:
    base = next((r["step_s"] for r in rows if r["method"] in ("allreduce", "zero2_adamw")), None)
    print(f"DeepSpeed engine, world_size={world_size}, params={rows[0]['params'] / 1e6:.2f}M")
    ddp = next((r["step_s"] for r in rows if r["method"] == "ddp_signsgd_mv"), None)
    print(
        f"{'method':>18} {'step ms':>9} {'vs base':>8} {'vs DDP hook':>12} {'MB/rank/step':>13} {'between nodes MB':>17}"
    )
    for r in rows:
        ratio = r["step_s"] / base if base else float("nan")
        vs_ddp = r["step_s"] / ddp if ddp else float("nan")
        between = " ".join(f"{b / 1e6:.3f}" for b in r.get("interface_payload_bytes_per_node", []))
        print(
            f"{r['method']:>18} {r['step_s'] * 1e3:>9.1f} {ratio:>8.2f} {vs_ddp:>12.2f} "
            f"{r['bytes_per_rank'] / 1e6:>13.3f} {between:>17}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("deepspeed-step", __doc__)
    add_methods_option(parser, "deepspeed-step", default=DEFAULT_METHODS)
    parser.add_argument("--world-size", type=int, default=2, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the rows to this file")
    args = parse_methods(parser, argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".cache", "torch_extensions"))
    if under_torchrun():
        rows = run_torchrun(_worker, args)
        if os.environ["RANK"] == "0":
            report(rows, int(os.environ["WORLD_SIZE"]))
            write_report("deepspeed-step", argv, {"rows": rows}, args.json)
        return rows
    rows = run_distributed(_worker, args.world_size, args, timeout=1200)[0]
    report(rows, args.world_size)
    write_report("deepspeed-step", argv, {"rows": rows}, args.json)
    return rows
