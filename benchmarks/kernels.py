"""Each stage of the vote's per-rank pipeline as a ratio to a memcpy of the same fp32 buffer.

The pipeline: pack the whole gradient (both planes, zero count and NaN/Inf check in one read),
draw the tie-break coins of this rank's 1/M shard, vote the shard from M packed vectors,
unpack the whole result. Target: the pipeline within 1.5x one memcpy. Signum-MV's hook packs
its momentum instead: the finiteness check of the gradient and ``momentum_pack`` (the momentum
step and pack, one pass with Triton), as a ratio to signSGD's pack, beside the two-pass form
(``lerp_``, then pack). It must read and write the momentum too: about 4x pack's bytes fused,
10x in two passes on a GPU (where the finiteness select adds passes). Ratios are measured in
one run, so a busy machine slows numerator and denominator alike. ``--kernels`` picks the
family (numba on CPU and Triton on CUDA by default; ``torch`` for the fallback).

    signmuon-bench kernels --sizes 1M 4M 16M 64M --world-size 4
"""

from __future__ import annotations

import torch

from signmuon.benchmarks.cli import check_device, command_parser, positive_int, size
from signmuon.benchmarks.launch import median_seconds
from signmuon.comm_hooks import SignSegments
from signmuon.comm_hooks.dist import nonfinite_flag
from signmuon.comm_hooks.kernels import kernels_for, warm_up
from signmuon.comm_hooks.kernels.layout import momentum_then_pack, words_for


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
            lambda: signum(lambda *a: momentum_then_pack(family.pack, *a)), repeats, device
        ),
        "ties": median_seconds(lambda: family.tie_words(segments, 7, 0, shard, device), repeats, device),
        "vote": median_seconds(lambda: family.vote(planes, None, None, tie), repeats, device),
        "unpack": median_seconds(lambda: family.unpack(positive, None, unpack_out), repeats, device),
        "unpack_ternary": median_seconds(lambda: family.unpack(positive, nonzero, unpack_out), repeats, device),
    }
    result["pipeline"] = result["pack"] + result["ties"] + result["vote"] + result["unpack"]
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("kernels", __doc__)
    parser.add_argument(
        "--sizes", nargs="+", type=size, default=["1M", "4M", "16M", "64M"], help="entries, e.g. 1M 64M"
    )
    parser.add_argument("--world-size", type=positive_int, default=4, help="M: the vote counts M packed shards")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = one core)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default="auto", choices=["auto", "numba", "triton", "torch"])
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    family = kernels_for(device, args.kernels).NAME
    print(
        f"device={device} kernels={family} threads={args.threads} world_size={args.world_size} torch={torch.__version__}"
    )
    print(
        f"{'entries':>10} {'memcpy ms':>10} {'pack/cp':>8} {'ties/cp':>8} {'vote/cp':>8} {'unpack/cp':>9} "
        f"{'ternary/cp':>10} {'pipeline/cp':>11} {'pack GB/s':>10} {'unpack GB/s':>11} {'signum/pack':>11} "
        f"{'2-pass/pack':>11}"
    )
    for numel in args.sizes:
        t = measure(numel, args.world_size, device, args.repeats, args.kernels)
        ratio = {k: v / t["memcpy"] for k, v in t.items()}
        rows.append(
            {
                "numel": numel,
                **{f"{k}_s": v for k, v in t.items()},
                **{f"{k}_ratio": v for k, v in ratio.items()},
                # bytes read + written: fp32 in, two planes out; one plane in, fp32 out
                "pack_gbps": (4 * numel + numel / 4) / t["pack"] / 1e9,
                "unpack_gbps": (numel / 8 + 4 * numel) / t["unpack"] / 1e9,
            }
        )
        print(
            f"{numel:>10} {t['memcpy'] * 1e3:>10.2f} {ratio['pack']:>8.2f} {ratio['ties']:>8.2f} {ratio['vote']:>8.2f} "
            f"{ratio['unpack']:>9.2f} {ratio['unpack_ternary']:>10.2f} {ratio['pipeline']:>11.2f} "
            f"{rows[-1]['pack_gbps']:>10.1f} {rows[-1]['unpack_gbps']:>11.1f} {t['signum'] / t['pack']:>11.2f} "
            f"{t['signum_two_pass'] / t['pack']:>11.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
