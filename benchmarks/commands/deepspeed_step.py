"""DeepSpeed engine step time: its default fp32 gradient all-reduce against the sign vote.

The same ~10M-parameter MLP, the same data, one run: the engine with a plain SGD client
optimizer (DeepSpeed all-reduces the gradients) and with ``SignSGDMV`` / ``SignMuon`` from the
config (all-reduce off, one-bit majority vote overlapped with backward, as the DDP hook does).
``ddp_signsgd_mv`` is the reference the engine should match: plain DDP with ``SignSGDMV``'s hook
on the same model in the same run; ``signsgd_mv_in_step`` votes in ``step()`` after backward
(``initialize(..., overlap_backward=False)``). Reports step time as a ratio to the all-reduce engine and to
that DDP step, and bytes sent per rank per step.

    python -m signmuon.benchmarks.commands.deepspeed_step --world-size 2
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch import nn

from signmuon.benchmarks.methods.registry import names_for
from signmuon.benchmarks.runtime.cli import command_parser, parse_methods
from signmuon.benchmarks.runtime.launch import run_distributed, timed_calls
from signmuon.benchmarks.workloads.models import mlp
from signmuon.comm_hooks.dist import ring_bytes

NAME = "deepspeed-step"
SUMMARY = "the DeepSpeed engine's step: its fp32 all-reduce against the sign vote"


METHODS = names_for("deepspeed-step")


def _config(method: str, batch: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
    if method.startswith("signsgd_mv"):
        config["optimizer"] = {"type": "SignSGDMV", "params": {"lr": 1e-4}}
    elif method == "signmuon":
        config["optimizer"] = {"type": "SignMuon", "params": {"lr": 1e-4}}
    return config


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    # Every method is built first and then timed in interleaved rounds, so drift on a shared
    # machine (and whatever runs first paying the allocator's warm-up) hits all methods alike.
    setups = {method: _setup(method, args) for method in args.methods}
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


def _setup(method: str, args: argparse.Namespace):
    """(one training step, the statistics counting its bytes or None for DeepSpeed's all-reduce,
    parameter count) of ``method`` on a fresh copy of the model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from signmuon.integrations import deepspeed as sm_ds
    from signmuon.optim import SignSGDMV

    torch.manual_seed(0)
    model = mlp(args.width, args.depth)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, 512)
    y = torch.randint(0, 10, (args.batch,))
    if method == "ddp_signsgd_mv":  # the same step under DDP with SignSGDMV's hook
        optimizer = SignSGDMV(model.parameters(), lr=1e-4)
        ddp = DDP(model)
        state = optimizer.register_comm_hook(ddp)

        def ddp_step():
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()

        return ddp_step, state.stats, params
    client = torch.optim.SGD(model.parameters(), lr=1e-4) if method == "allreduce" else None
    engine, optimizer, _, _ = sm_ds.initialize(
        model=model,
        config=_config(method, args.batch),
        optimizer=client,
        overlap_backward=not method.endswith("in_step"),
    )

    def engine_step():
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()

    # Overlapped, the hook state counts the bytes; voting in step(), the optimizer does.
    stats = None if method == "allreduce" else optimizer.stats if optimizer.vote_in_step else optimizer.comm_state.stats
    return engine_step, stats, params


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("deepspeed-step", __doc__, methods="deepspeed-step")
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
