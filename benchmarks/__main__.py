"""``signmuon-bench COMMAND [options]`` (or ``python -m signmuon.benchmarks COMMAND``).

Commands:
  demo            the README's main job: 4 local ranks on digits, methods side by side, curves
  train           the training benchmark (accuracy or perplexity, bytes per rank, step time)
  bandwidth       message sizes x reduction methods: time, bytes per rank, algbw/busbw, speed-up
  netem           run a benchmark across network namespaces with tc-limited links (root, iproute2)
  kernels         pack / vote / unpack time as ratios to memcpy
  ddp-step        DDP step time of a ~10M-parameter MLP: fp32 all-reduce, fp16, PowerSGD, sign vote
  deepspeed-step  the DeepSpeed engine's step: its fp32 all-reduce against the sign vote
  ns-time         Newton–Schulz time per matrix size (what SignMuon adds to a step)
  direction-time  SignMuon's pre-vote work per step by path (matrices, the rest) against fwd+bwd
  sweep           learning-rate sweep: methods x lr factors x seeds, the tuned factor per method
  dppf-sweep      DPPF against local SGD: a pull/push grid per averaging period, over seeds
  round-time      a one-bit round's combination: a scale per block of B entries against one per tensor
  ns-precision    signs Newton–Schulz flips in float32 / bfloat16 against float64, and the cost
  plan            an α–β model: bytes and step time per method on a cluster, speed-up, crossover
  zero-structure  where a ReLU model's exact zeros lie, and what coding them by rows and columns costs
  lost-node       DiLoCo rounds under torchft's Manager: a replica group killed, then healed
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys

# command -> module of signmuon.benchmarks whose main(argv) runs it
COMMANDS = {
    "train": "train",
    "bandwidth": "bandwidth",
    "netem": "netem",
    "kernels": "kernels",
    "ddp-step": "ddp_step",
    "deepspeed-step": "deepspeed_step",
    "ns-time": "ns_time",
    "direction-time": "direction_time",
    "ns-precision": "ns_precision",
    "round-time": "round_time",
    "sweep": "sweep",
    "dppf-sweep": "dppf_sweep",
    "plan": "plan",
    "zero-structure": "zero_structure",
    "lost-node": "lost_node",
}
DEMO = [
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
DEMO_HELP = (
    """usage: signmuon-bench demo [train options]

The main job: trains on scikit-learn's digits on 4 local gloo ranks for 300 steps with DDP+AdamW,
Signum-MV, SignMuon and DPPF (period 8), evaluating every 25 steps; prints accuracy, bytes sent
per rank, communication rounds and step time per method, and writes test loss against step,
bytes sent and wall time to demo_curves.png. It is `signmuon-bench train` with these options:

    """
    + " ".join(DEMO)
    + """

Any train option given after `demo` is added after them and wins (e.g. --steps 100);
`signmuon-bench train --help` lists them. After the table it prints each method's projected time
to the target at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s (measured compute and bytes; a projection).

`--link RATE` (e.g. 100mbit) runs the same on real shaped links instead: each rank in its own
network namespace with its link limited by tc (`signmuon-bench netem`; needs root and iproute2).
Where that is not possible it says why and prints the projection."""
)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "demo":  # 4 local gloo ranks on digits: DDP+AdamW against Signum-MV, SignMuon and DPPF
        if "-h" in rest or "--help" in rest:
            print(DEMO_HELP)
            return
        command, rest = "train", DEMO + rest
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
                print(
                    f"demo --link {rate}: cannot shape links here ({why}); the table ends with the projection instead"
                )
    if command not in COMMANDS:
        sys.exit(f"signmuon-bench: unknown command {command!r}\n{__doc__}")
    importlib.import_module(f"signmuon.benchmarks.{COMMANDS[command]}").main(rest)
    importlib.import_module("signmuon.benchmarks.launch").end_torchrun_process()


if __name__ == "__main__":
    main()
