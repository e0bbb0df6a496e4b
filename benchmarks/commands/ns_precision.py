"""How many signs Newton–Schulz flips in each compute precision, and what each costs.

SignMuon votes ``sign(NS(M))``: an entry whose sign rounding flips is a full-size wrong step
(for Muon it would be a tiny one). Low-rank momentum, what small per-worker batches give, is the
hard case: NS multiplies small singular values by up to ~3.4 per iteration, so rounding noise in
the null space grows to the size of the signal. For each size, rank and precision this reports
the fraction of entries whose sign differs from a float64 reference, and the time of one call.

    python -m signmuon.benchmarks ns-precision --sizes 256 1024 4096 --ranks 8 32 0 --device cuda
"""

from __future__ import annotations

import statistics
import time

import torch

from signmuon.benchmarks.runtime.cli import check_device, command_parser, positive_int
from signmuon.optim import newton_schulz

# name -> (precision of the first iterations, of the last `tail` iterations, tail); a precision is
# a dtype or a name newton_schulz takes ("tfloat32": float32 with TF32 matmuls, for the call)
PRECISIONS = {
    "float32": (torch.float32, torch.float32, 0),
    "tfloat32": ("tfloat32", "tfloat32", 0),
    "bfloat16": (torch.bfloat16, torch.bfloat16, 0),
    "bf16+fp32 last 2": (torch.bfloat16, torch.float32, 2),
}


NAME = "ns-precision"
SUMMARY = "signs Newton–Schulz flips in float32 / bfloat16 against float64, and the cost"


def momentum(size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """[size, size] Gaussian matrix of the given rank (0: full rank), float64."""
    gen = torch.Generator().manual_seed(seed)
    if rank == 0:
        return torch.randn(size, size, generator=gen, dtype=torch.float64).to(device)
    left = torch.randn(size, rank, generator=gen, dtype=torch.float64)
    right = torch.randn(rank, size, generator=gen, dtype=torch.float64)
    return (left @ right).to(device)


def run_ns(x: torch.Tensor, precision: str, steps: int = 5) -> torch.Tensor:
    head, tail_dtype, tail = PRECISIONS[precision]
    if tail == 0:
        return newton_schulz(x, steps, dtype=head)
    # The last iterations continue from the first ones' output, already normalised (norm ~ 1).
    y = newton_schulz(x, steps - tail, dtype=head)
    return newton_schulz(y, tail, dtype=tail_dtype)


def flip_fraction(x: torch.Tensor, precision: str) -> float:
    reference = torch.sign(newton_schulz(x, dtype=torch.float64))
    got = torch.sign(run_ns(x.float(), precision).double())
    return (got != reference).double().mean().item()


def seconds(x: torch.Tensor, precision: str, repeats: int) -> float:
    x = x.float()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    run_ns(x, precision)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_ns(x, precision)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("ns-precision", __doc__)
    parser.add_argument(
        "--sizes", nargs="+", type=positive_int, default=[256, 1024], help="square matrix sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--ranks", nargs="+", type=int, default=[8, 32, 0], help="momentum ranks, 0 = full rank (default: %(default)s)"
    )
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--seeds", type=positive_int, default=2, help="matrices per case (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls (default: %(default)s)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)"
    )
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    device = torch.device(args.device)
    if any(r < 0 for r in args.ranks):
        parser.error(f"--ranks {args.ranks}: each must be >= 0 (0 = full rank)")
    rows = []
    print(f"sign flips of NS(M) against float64, device={device}")
    print(f"{'size':>6} {'rank':>5} {'precision':>18} {'flips %':>9} {'max %':>7} {'ms/call':>9}")
    for size in args.sizes:
        for rank in args.ranks:
            xs = [momentum(size, rank, seed, device) for seed in range(args.seeds)]
            for precision in args.precisions:
                flips = [flip_fraction(x, precision) for x in xs]
                ms = seconds(xs[0], precision, args.repeats) * 1e3
                row = {
                    "size": size,
                    "rank": rank,
                    "precision": precision,
                    "flips": statistics.mean(flips),
                    "max_flips": max(flips),
                    "ms": ms,
                }
                rows.append(row)
                label = "full" if rank == 0 else str(rank)
                print(
                    f"{size:>6} {label:>5} {precision:>18} {100 * row['flips']:>9.3f} {100 * row['max_flips']:>7.3f} {ms:>9.2f}"
                )
    return rows
