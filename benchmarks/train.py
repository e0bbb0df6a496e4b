"""Data-parallel training benchmark: accuracy, bytes sent per rank and step time per method.

Task ``digits``: scikit-learn's 8x8 digits (ships with scikit-learn, no download), a small
CNN, a fixed 80/20 split. Each step every rank draws its own slice of the global batch.

    python -m signmuon.benchmarks.train --world-size 4 --methods adamw signsgd_mv signum_mv
    torchrun --nproc-per-node 4 -m signmuon.benchmarks.train
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.benchmarks.launch import run_distributed, run_torchrun, under_torchrun
from signmuon.comm_hooks import CommStats, SignVoteState, allreduce_hook, sign_vote_hook
from signmuon.optim import MuonWithAdamW, SignMuon


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """One training run."""

    steps: int = 300
    """Optimizer steps (every rank takes the same number)."""
    batch_size: int = 64
    """Global batch; each of M ranks takes batch_size // M examples per step."""
    seed: int = 0
    """Model initialisation and data order; equal seeds give equal runs."""
    eval_every: int = 100
    """Steps between evaluations on the held-out split."""


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train [N,1,8,8], y_train, x_test, y_test) from scikit-learn's digits, scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("the digits task needs scikit-learn: pip install 'signmuon[bench]'") from error
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


# A method wraps the model (DDP with a hook, or anything else) and returns
# (model, optimizer, stats): stats counts the bytes this rank sends.
Method = Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer, CommStats]]


def _ddp_allreduce(make_opt) -> Method:
    def build(net: nn.Module):
        model = DDP(net)
        stats = CommStats()
        model.register_comm_hook(stats, allreduce_hook)
        return model, make_opt(model.parameters()), stats

    return build


def _ddp_sign_vote(momentum: float, lr: float) -> Method:
    def build(net: nn.Module):
        model = DDP(net)
        state = SignVoteState(momentum=momentum, start_iter=1)
        model.register_comm_hook(state, sign_vote_hook)
        return model, torch.optim.SGD(model.parameters(), lr=lr), state.stats

    return build


def _ddp_sign_muon(**options) -> Method:
    def build(net: nn.Module):
        opt = SignMuon(net.parameters(), **options)
        model = DDP(net)
        opt.register_comm_hook(model)
        return model, opt, opt.comm_state.stats

    return build


METHODS: dict[str, Method] = {
    "adamw": _ddp_allreduce(lambda p: torch.optim.AdamW(p, lr=2e-3)),
    "sgd": _ddp_allreduce(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "signsgd_mv": _ddp_sign_vote(momentum=0.0, lr=1e-3),
    "signum_mv": _ddp_sign_vote(momentum=0.9, lr=1e-3),
    "muon_adamw": _ddp_allreduce(lambda p: MuonWithAdamW(p, lr=0.02, adamw_lr=2e-3)),
    "signmuon": _ddp_sign_muon(lr=2e-3),
    "signmuon_polar": _ddp_sign_muon(lr=2e-3, polar_after_vote=True),
}


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train(was_training)
    return correct / len(y)


def train_worker(rank: int, world_size: int, method: str, config: TrainConfig) -> dict:
    """Train ``method`` on this rank; every rank returns the same final metrics."""
    if config.batch_size % world_size:
        raise ValueError(f"batch_size={config.batch_size} must divide by the world size {world_size}")
    x_train, y_train, x_test, y_test = digits_data(config.seed)
    torch.manual_seed(config.seed)
    model, opt, stats = METHODS[method](digits_cnn())
    per_rank = config.batch_size // world_size
    data_gen = torch.Generator().manual_seed(config.seed + 1)  # same on every rank: disjoint slices
    log, step_times = [], []
    for step in range(config.steps):
        batch = torch.randint(0, len(y_train), (config.batch_size,), generator=data_gen)
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - start)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            log.append({"step": step + 1, "loss": loss.item(), "test_acc": accuracy(model, x_test, y_test)})
    return {
        "method": method,
        "world_size": world_size,
        "test_acc": log[-1]["test_acc"],
        "bytes_per_rank": stats.bytes_sent,
        "step_ms": 1e3 * statistics.median(step_times),
        "log": log,
    }


def run(methods: list[str], world_size: int, config: TrainConfig) -> list[dict]:
    """Each method on ``world_size`` local gloo ranks (or the torchrun ranks); rank 0's results."""
    results = []
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
        if under_torchrun():
            results.append(run_torchrun(train_worker, method, config))
        else:
            results.append(run_distributed(train_worker, world_size, method, config)[0])
    return results


def print_table(results: list[dict]) -> None:
    base = next((r["bytes_per_rank"] for r in results if r["method"] == "adamw"), None)
    print(f"{'method':>12} {'test acc':>9} {'MB sent/rank':>13} {'vs adamw':>9} {'step ms':>8}")
    for r in results:
        ratio = f"{r['bytes_per_rank'] / base:.3f}" if base else "-"
        print(f"{r['method']:>12} {r['test_acc']:>9.3f} {r['bytes_per_rank'] / 1e6:>13.3f} {ratio:>9} {r['step_ms']:>8.2f}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"of {sorted(METHODS)}")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    results = run(args.methods, args.world_size, config)
    if not under_torchrun() or os.environ.get("RANK") == "0":
        print_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
