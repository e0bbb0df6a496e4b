"""``signmuon-bench COMMAND [options]`` (or ``python -m signmuon.benchmarks COMMAND``).

Commands:
  demo       the README's main job: 4 local ranks on digits, methods side by side
  train      the training benchmark (accuracy, bytes per rank, step time)
  kernels    pack / vote / unpack time as ratios to memcpy
  bandwidth  message sizes x reduction methods: time, bytes per rank, algbw/busbw, speed-up
  netem      run a benchmark across network namespaces with tc-limited links (root, iproute2)
  ddp-step   DDP step time of a ~10M-parameter MLP: fp32 all-reduce, fp16, PowerSGD, sign vote
  deepspeed-step  the DeepSpeed engine's step: its fp32 all-reduce against the sign vote
  ns-time    Newton–Schulz time per matrix size (what SignMuon adds to a step)
"""

from __future__ import annotations

import sys


def demo(argv: list[str]) -> None:
    """4 local gloo ranks on digits: DDP+AdamW against Signum-MV, SignMuon and DPPF."""
    from signmuon.benchmarks import train

    train.main(["--world-size", "4", "--steps", "300", "--methods", "adamw", "signum_mv", "signmuon", "dppf_8",
                "--plot", "demo_curves.png", *argv])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "demo":
        demo(rest)
    elif command == "train":
        from signmuon.benchmarks import train

        train.main(rest)
    elif command == "bandwidth":
        from signmuon.benchmarks import bandwidth

        bandwidth.main(rest)
    elif command == "ns-time":
        from signmuon.benchmarks import ns_time

        ns_time.main(rest)
    elif command == "netem":
        from signmuon.benchmarks import netem

        netem.main(rest)
    elif command == "kernels":
        from signmuon.benchmarks import kernels

        kernels.main(rest)
    elif command == "deepspeed-step":
        from signmuon.benchmarks import deepspeed_step

        deepspeed_step.main(rest)
    elif command == "ddp-step":
        from signmuon.benchmarks import ddp_step

        ddp_step.main(rest)
    else:
        sys.exit(f"signmuon-bench: unknown command {command!r}\n{__doc__}")


if __name__ == "__main__":
    main()
