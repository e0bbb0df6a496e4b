"""What the cost model is fed, measured here: the vote's kernels (the seconds of each stage
against a memcpy), a workload's size and throughputs, and the latency of a message round."""

from __future__ import annotations

import statistics
import time

import torch

from signmuon.benchmarks.cost.model import Workload
from signmuon.benchmarks.runtime.launch import median_seconds, run_distributed
from signmuon.benchmarks.workloads.models import mlp
from signmuon.comm_hooks import SignSegments
from signmuon.comm_hooks.dist import all_reduce, nonfinite_flag
from signmuon.comm_hooks.kernels import kernels_for, warm_up
from signmuon.comm_hooks.kernels.bits import advance_momentum_then_pack, words_for

__all__ = ["measure", "measure_latency", "measure_model", "measure_workload"]


def measure(
    numel: int, world_size: int, device: torch.device, repeats: int = 5, kernels: str = "auto"
) -> dict[str, float]:
    """Seconds for memcpy and each stage on ``numel`` fp32 entries."""
    family = kernels_for(device, kernels)
    warm_up(device, (torch.float32,), kernels)  # the first compile is not a kernel's time
    x = torch.randn(numel, device=device)
    copy_out = torch.empty_like(x)
    unpack_out = torch.empty_like(x)
    words = words_for(numel)
    shard = -(-words // world_size)
    positive, nonzero, _, _ = family.pack(x, shard * world_size)
    gen = torch.Generator(device=device).manual_seed(0)
    planes = torch.randint(0, 256, (world_size, shard * 8), dtype=torch.uint8, device=device, generator=gen)
    planes = planes.view(torch.int64)  # [M, S]: the shard this rank votes
    segments = SignSegments.whole(numel)
    tie = family.tie_words(segments, 7, 0, shard, device)
    momentum = torch.zeros_like(x)

    def signum(momentum_pack):
        momentum_pack(momentum, x, 0.1, nonfinite_flag(x), shard * world_size)

    result = {
        "memcpy": median_seconds(lambda: copy_out.copy_(x), repeats, device),
        "pack": median_seconds(lambda: family.pack(x, shard * world_size), repeats, device),
        "signum": median_seconds(lambda: signum(family.momentum_pack), repeats, device),
        "signum_two_pass": median_seconds(
            lambda: signum(lambda *a: advance_momentum_then_pack(family.pack, *a)), repeats, device
        ),
        "ties": median_seconds(lambda: family.tie_words(segments, 7, 0, shard, device), repeats, device),
        "vote": median_seconds(lambda: family.vote(planes, None, None, tie), repeats, device),
        "unpack": median_seconds(lambda: family.unpack(positive, None, unpack_out), repeats, device),
        "unpack_ternary": median_seconds(lambda: family.unpack(positive, nonzero, unpack_out), repeats, device),
    }
    result["pipeline"] = result["pack"] + result["ties"] + result["vote"] + result["unpack"]
    return result


def measure_workload(width: int, depth: int = 2) -> Workload:
    """The model's inputs for ``ddp-step``'s MLP measured on this CPU (:func:`measure_model`)."""
    return measure_model(mlp(width, depth))


def measure_model(net: torch.nn.Module) -> Workload:
    """A model's size and hidden matrices (its 2-D weights other than embeddings), and the vote
    kernels' and Newton–Schulz's throughput on this CPU, one thread as a rank has (compute left
    at 0: the caller measures it)."""
    params = sum(p.numel() for p in net.parameters())
    embeddings = {id(m.weight) for m in net.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = tuple(tuple(p.shape) for p in net.parameters() if p.dim() == 2 and id(p) not in embeddings)
    width = max((min(shape) for shape in matrices), default=64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels = measure(params, 2, torch.device("cpu"))
        a, b = torch.randn(width, width), torch.randn(width, width)
        matmul = median_seconds(lambda: a @ b, 5, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    return Workload(
        params,
        0.0,
        matrices,
        kernel_bytes_per_s=4 * params / kernels["pipeline"],
        ns_flops_per_s=2 * width**3 / matmul,
    )


def _round_trip(rank: int, world_size: int) -> float:
    x = torch.zeros(1)
    for _ in range(20):
        all_reduce(x, None)
    times = []
    for _ in range(100):
        start = time.perf_counter()
        all_reduce(x, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_latency() -> float:
    """α, seconds per message round: a one-entry gloo all-reduce of 2 local ranks (2 rounds)
    halved, as a user takes a link's latency from a small-message test."""
    return max(run_distributed(_round_trip, 2)) / 2
