"""The README's main job: DDP+AdamW against the one-bit methods, side by side, with curves.

It is ``signmuon-bench train`` with the options in :data:`OPTIONS`; see ``--help``.
"""

from __future__ import annotations

import os
import shutil
import sys

from signmuon.benchmarks.commands import load

NAME = "demo"
SUMMARY = "the README's main job: 4 local ranks on digits, methods side by side, curves"

OPTIONS = [
    "--world-size",
    "4",
    "--steps",
    "300",
    "--eval-every",
    "25",
    "--methods",
    "adamw",
    "signum_mv",
    "signmuon",
    "dppf_8",
    "--plot",
    "demo_curves.png",
]
HELP = (
    """usage: signmuon-bench demo [train options]

The main job: trains on scikit-learn's digits on 4 local gloo ranks for 300 steps with DDP+AdamW,
Signum-MV, SignMuon and DPPF (period 8), evaluating every 25 steps; prints accuracy, bytes sent
per rank, communication rounds and step time per method, and writes test loss against step,
bytes sent and wall time to demo_curves.png. It is `signmuon-bench train` with these options:

    """
    + " ".join(OPTIONS)
    + """

Any train option given after `demo` is added after them and wins (e.g. --steps 100);
`signmuon-bench train --help` lists them. After the table it prints each method's projected time
to the target at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s (measured compute and bytes; a projection).

`--link RATE` (e.g. 100mbit) runs the same on real shaped links instead: each rank in its own
network namespace with its link limited by tc (`signmuon-bench netem`; needs root and iproute2).
Where that is not possible it says why and prints the projection."""
)


def main(argv: list[str] | None = None):
    rest = sys.argv[1:] if argv is None else list(argv)
    if "-h" in rest or "--help" in rest:
        print(HELP)
        return None
    command, rest = "train", OPTIONS + rest
    if "--link" in rest:
        at = rest.index("--link")
        if at + 1 >= len(rest):
            sys.exit("signmuon-bench demo: --link needs a rate, e.g. --link 100mbit")
        rate, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if os.geteuid() == 0 and not missing:
            command, rest = "netem", ["--world-size", "4", "--rate", rate, "--delay", "", "--", "train", *rest]
        else:
            why = "it needs root" if os.geteuid() != 0 else f"{' and '.join(missing)} not found (iproute2)"
            print(f"demo --link {rate}: cannot shape links here ({why}); the table ends with the projection instead")
    return load(command).main(rest)
