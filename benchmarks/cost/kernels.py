"""The vote's kernels timed: the seconds of each stage against a memcpy (the cost model's kernel throughput)."""

from __future__ import annotations

import torch

from signmuon.benchmarks.runtime.launch import median_seconds
from signmuon.comm_hooks import SignSegments
from signmuon.comm_hooks.dist import nonfinite_flag
from signmuon.comm_hooks.kernels import kernels_for, warm_up
from signmuon.comm_hooks.kernels.bits import advance_momentum_then_pack, words_for

__all__ = ["measure"]


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
