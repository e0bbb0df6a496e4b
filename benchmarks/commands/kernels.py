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

from signmuon.benchmarks.cost.kernels import measure
from signmuon.benchmarks.runtime.cli import check_device, command_parser, positive_int, size
from signmuon.comm_hooks.kernels import kernels_for

NAME = "kernels"
SUMMARY = "pack / vote / unpack time as ratios to memcpy"


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
