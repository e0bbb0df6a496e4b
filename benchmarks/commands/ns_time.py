"""Newton–Schulz time per matrix size: the compute SignMuon adds to each step (twice with
the post-vote polar step), in float32 (SignMuon's default) or bfloat16.

    python -m signmuon.benchmarks ns-time --sizes 512 1024 2048 4096 --device cuda
"""

from __future__ import annotations

import torch

from signmuon.benchmarks.runtime.cli import command_parser
from signmuon.benchmarks.runtime.launch import median_seconds
from signmuon.optim import newton_schulz
from signmuon.optim.sign_muon import NS_DTYPES

NAME = "ns-time"
SUMMARY = "Newton–Schulz time per matrix size (what SignMuon adds to a step)"


def measure(size: int, device: torch.device, dtype: torch.dtype | str, steps: int, repeats: int) -> float:
    """Median seconds of one ``newton_schulz`` call on a [size, size] matrix."""
    x = torch.randn(size, size, device=device)
    return median_seconds(lambda: newton_schulz(x, steps, dtype=dtype), repeats, device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("ns-time", __doc__)
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 512, 1024])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default="float32", choices=list(NS_DTYPES), help="(default: %(default)s, SignMuon's)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype  # a name newton_schulz takes
    print(f"device={device} dtype={dtype} ns_steps={args.steps} torch={torch.__version__}")
    print(f"{'size':>6} {'ms':>9} {'TFLOP/s':>8}")
    rows = []
    for size in args.sizes:
        seconds = measure(size, device, dtype, args.steps, args.repeats)
        flops = args.steps * 3 * 2 * size**3  # three size^3 matmuls per iteration
        rows.append({"size": size, "seconds": seconds, "tflops": flops / seconds / 1e12})
        print(f"{size:>6} {seconds * 1e3:>9.3f} {flops / seconds / 1e12:>8.2f}")
    return rows
