"""DeepSpeed engine step time: its default fp32 gradient all-reduce against the sign vote.

The same ~10M-parameter MLP, the same data, one run: the engine with a plain SGD client
optimizer (DeepSpeed all-reduces the gradients) and with ``SignSGDMV`` / ``SignMuon`` from the
config (all-reduce off, one-bit majority vote in the optimizer). Reports step time as a ratio
to the all-reduce engine and bytes sent per rank per step.

    python -m signmuon.benchmarks.deepspeed_step --world-size 2
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch import nn

from signmuon.benchmarks.ddp_step import mlp
from signmuon.benchmarks.launch import run_distributed, timed_calls

METHODS = ("allreduce", "signsgd_mv", "signmuon")


def _config(method: str, batch: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
    if method == "signsgd_mv":
        config["optimizer"] = {"type": "SignSGDMV", "params": {"lr": 1e-4}}
    elif method == "signmuon":
        config["optimizer"] = {"type": "SignMuon", "params": {"lr": 1e-4}}
    return config


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    from signmuon.integrations import deepspeed as sm_ds

    rows = []
    for method in args.methods:
        torch.manual_seed(0)
        model = mlp(args.width, args.depth)
        client = torch.optim.SGD(model.parameters(), lr=1e-4) if method == "allreduce" else None
        engine, optimizer, _, _ = sm_ds.initialize(model=model, config=_config(method, args.batch), optimizer=client)
        x = torch.randn(args.batch, 512)
        y = torch.randint(0, 10, (args.batch,))

        def step():
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()

        timed_calls(step, args.warmup)
        sent_before = optimizer.stats.bytes_sent if hasattr(optimizer, "stats") else 0
        times = timed_calls(step, args.steps)
        params = sum(p.numel() for p in model.parameters())
        if hasattr(optimizer, "stats"):
            per_step = (optimizer.stats.bytes_sent - sent_before) / args.steps
        else:
            per_step = 2 * (world_size - 1) * params * 4 / world_size  # ring all-reduce of fp32 gradients
        rows.append({"method": method, "params": params, "step_s": statistics.median(times), "bytes_per_rank": per_step})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--width", type=int, default=1728)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".cache", "torch_extensions"))
    rows = run_distributed(_worker, args.world_size, args, timeout=1200)[0]
    base = next(r["step_s"] for r in rows if r["method"] == "allreduce") if "allreduce" in args.methods else None
    print(f"DeepSpeed engine, world_size={args.world_size}, params={rows[0]['params'] / 1e6:.1f}M")
    print(f"{'method':>11} {'step ms':>9} {'vs fp32':>8} {'MB/rank/step':>13}")
    for r in rows:
        ratio = r["step_s"] / base if base else float("nan")
        print(f"{r['method']:>11} {r['step_s'] * 1e3:>9.1f} {ratio:>8.2f} {r['bytes_per_rank'] / 1e6:>13.3f}")
    return rows


if __name__ == "__main__":
    main()
