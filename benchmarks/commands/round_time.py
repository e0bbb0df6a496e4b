"""A one-bit round's combination time with a scale per block of B entries against one scale per
tensor (``OuterStep(scale_block=B)``), on one process: the scales, the error feedback and the
local vote, which is what the block size changes (the bytes on the wire are the plan's).

    signmuon-bench round-time --entries 50000000 --block 64
"""

from __future__ import annotations

import torch

from signmuon.benchmarks.runtime.cli import command_parser, positive_int
from signmuon.benchmarks.runtime.launch import median_seconds
from signmuon.optim.rounds.pseudo_gradients import combine_pseudo_gradients, scale_blocks

NAME = "round-time"
SUMMARY = "a one-bit round's combination: a scale per block of B entries against one per tensor"


def measure(entries: int, tensors: int, block: int, rule: str, repeats: int, device: torch.device) -> float:
    """Median seconds of combining a flat pseudo-gradient of ``entries`` in ``tensors`` tensors."""
    sizes = tuple(entries // tensors + (i < entries % tensors) for i in range(tensors))
    delta = torch.randn(entries, generator=torch.Generator().manual_seed(0)).to(device)
    errors = (torch.zeros_like(delta),) if rule == "sign_vote_ef" else ()
    segments = scale_blocks(sizes, 0, entries, block)
    work = delta.clone()

    def combine():
        work.copy_(delta)
        combine_pseudo_gradients(work, rule, None, None, segments=segments, errors=errors)

    return median_seconds(combine, repeats, device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("round-time", __doc__)
    parser.add_argument("--entries", type=positive_int, default=50_000_000)
    parser.add_argument(
        "--tensors", type=positive_int, default=100, help="tensors the entries split into (default: %(default)s)"
    )
    parser.add_argument("--block", type=positive_int, default=64)
    parser.add_argument(
        "--rules", nargs="+", default=["sign_vote", "sign_vote_ef"], choices=["sign_vote", "sign_vote_ef"]
    )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"entries={args.entries} tensors={args.tensors} device={device} torch={torch.__version__}")
    print(f"{'rule':>13} {'per tensor s':>13} {f'block {args.block} s':>12} {'ratio':>6}")
    rows = []
    for rule in args.rules:
        whole = measure(args.entries, args.tensors, 0, rule, args.repeats, device)
        blocks = measure(args.entries, args.tensors, args.block, rule, args.repeats, device)
        rows.append(
            {"rule": rule, "block": args.block, "per_tensor_s": whole, "block_s": blocks, "ratio": blocks / whole}
        )
        print(f"{rule:>13} {whole:>13.3f} {blocks:>12.3f} {blocks / whole:>6.2f}")
    return rows
