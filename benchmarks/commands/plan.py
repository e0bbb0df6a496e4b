"""Plan a cluster: bytes, communication and step time per method from an α–β model (``cost/model.py``),
the speed-up over the fp32 all-reduce, and the crossover (the link rate above which the vote
stops paying).

    signmuon-bench plan --model gpt-1.3b --nodes 16 --ranks-per-node 8 --link 100gbit
    signmuon-bench plan --params 14e6 --compute-ms 40 --nodes 2 --ranks-per-node 4 --link 1gbit --measure-kernels
    signmuon-bench plan --projection --plot projection.png     # published GPU-cluster figures
    signmuon-bench plan --choice --json choice.json            # every method per model and link rate
    sudo signmuon-bench plan --validate --repeats 3 --uncrowded   # the model against netem runs here

Compute time per step: ``--compute-ms``, or 6·n·tokens / throughput (``--tokens-per-rank``,
``--tflops``). The kernels' throughput: ``--kernel-gbps``, or ``--measure-kernels`` on this
device (``signmuon-bench kernels``; ``gpu_check.sh`` on a GPU). Assumptions of the projection
are printed with it; it is a projection, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math

from signmuon.benchmarks.commands import load
from signmuon.benchmarks.cost.model import Cluster, Workload, compute_for, parse_rate, predict
from signmuon.benchmarks.cost.projection import GPT_SIZES, choice, model_shapes, projection
from signmuon.benchmarks.cost.validation import median_rows
from signmuon.benchmarks.methods.registry import names_for
from signmuon.benchmarks.reports.plan_table import plan_rows, print_plan
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import command_parser, positive_int

NAME = "plan"
SUMMARY = "an α–β model: bytes and step time per method on a cluster, speed-up, crossover"


__all__ = ["UNCROWDED_LAYOUTS", "VALIDATION_LAYOUTS", "main", "validate"]


VALIDATION_LAYOUTS = (
    (4, 1, ("allreduce", "fp16_allreduce", "signsgd_mv", "signum_mv", "signmuon")),
    (4, 2, ("allreduce", "signsgd_mv_node", "signum_mv_node", "signmuon_node")),
)
"""(ranks, ranks per node, methods) of the validation's points: the issue's 4 ranks, flat and 2 × 2."""
UNCROWDED_LAYOUTS = ((2, 1, ("allreduce", "fp16_allreduce", "signsgd_mv", "signum_mv", "signmuon")),)
"""The same flat points on 2 ranks, one per core of a 2-core machine (``--uncrowded``)."""


def validate(
    rates=("30mbit", "100mbit", "1gbit"),
    base="10gbit",
    width: int = 512,
    steps: int = 8,
    repeats: int = 1,
    layouts=VALIDATION_LAYOUTS,
) -> list[dict]:
    """:func:`~signmuon.benchmarks.cost.model.predict` against step times measured under
    ``netem`` (root), per layout of ``layouts``.

    The model gets what a user would give it: the model's size and matrix shapes (``ddp-step``'s
    MLP); from one unshaped run, the compute time (at which the model gives the fp32 all-reduce's
    step measured at ``base``: :func:`~signmuon.benchmarks.cost.model.compute_for`) and, per
    vote, what ``ddp-step`` prints of it: the zeros' bits (its bits per entry less one, to two
    decimals) and the vote's kernel time per step on these gradients (the hook's host seconds
    encoding, voting and decoding, zeros included; an all-reduce keeps the kernels measured by
    :func:`~signmuon.benchmarks.cost.kernels.measure_workload`); Newton–Schulz's throughput
    measured on this CPU; and the link: its rate (one shaped NIC per node; loopback inside a node
    taken at ``base``) and its latency (:func:`~signmuon.benchmarks.cost.kernels.measure_latency`).
    Bytes, latency, overlap and kernel terms are the model's own: nothing is taken from the
    shaped runs. With ``repeats``, whole passes run one after another and each
    point is the median of its passes (:func:`median_rows`). Each world size is counted on its
    own: with more ranks than cores the ranks share the cores, which the model does not know."""
    rows = median_rows([_validation_pass(rates, base, width, steps, layouts) for _ in range(repeats)])
    print(
        f"{'layout':>6} {'method':>16} {'rate':>8} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10} "
        f"{'MB crossing (model/counted)':>28} {'zero bits':>9} {'kernel ms':>9}"
        + ("  each pass" if repeats > 1 else "")
    )
    for r in rows:
        passes = "  " + " ".join(f"{x:.2f}" for x in r["pass_ratios"]) if repeats > 1 else ""
        crossing = f"{r['bytes_crossing'] / 1e6:.3f}/{r['measured_crossing'] / 1e6:.3f}"
        print(
            f"{r['layout']:>6} {r['method']:>16} {r['rate']:>8} {r['predicted_s'] * 1e3:>13.1f} "
            f"{r['measured_s'] * 1e3:>12.1f} {r['ratio']:>10.2f} {crossing:>28} {r['zero_bits']:>9.2f} "
            f"{r['kernel_s'] * 1e3:>9.2f}{passes}"
        )
    for world_size in sorted({r["world_size"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["world_size"] == world_size]
        within = sum(abs(r["ratio"] - 1) <= 0.2 for r in mine)
        print(
            f"{within} of {len(mine)} points on {world_size} ranks within 20% of cost.predict()"
            + (f" (medians of {repeats} passes)" if repeats > 1 else "")
        )
    return rows


def _validation_pass(rates, base: str, width: int, steps: int, layouts) -> list[dict]:
    netem = load("netem")  # a command: validation runs ddp-step across shaped links
    from signmuon.benchmarks.cost.kernels import measure_latency, measure_workload  # numba: only here

    inputs = measure_workload(width)
    latency = measure_latency()
    rows = []
    for world_size, per_node, methods in layouts:
        measured = {}
        for rate in (base, *rates):
            report = netem.main(
                [
                    "--world-size",
                    str(world_size),
                    "--ranks-per-node",
                    str(per_node),
                    "--rate",
                    rate,
                    "--",
                    "ddp-step",
                    "--width",
                    str(width),
                    "--depth",
                    "2",
                    "--steps",
                    str(steps),
                    "--warmup",
                    "3",
                    "--methods",
                    *methods,
                ]
                + (["--ranks-per-node", str(per_node)] if per_node > 1 else [])
            )
            measured[rate] = {r["method"]: r for r in report["rows"]}

        def cluster(rate: str, nodes: int = world_size // per_node) -> Cluster:
            return Cluster(
                nodes,
                per_node,
                parse_rate(rate),
                nics_per_node=1,
                latency_s=latency,
                intra_bps=parse_rate(base),
                intra_latency_s=latency,
            )

        # The compute time from the unshaped run: the fp32 all-reduce's step less what the model adds to it.
        compute = compute_for("allreduce", cluster(base), inputs, measured[base]["allreduce"]["step_s"])
        workload = dataclasses.replace(inputs, compute_s=compute)
        for method in methods:
            got = measured[base][method]
            counted = got["between_nodes_bytes_per_node"] if method.endswith("_node") else got["bytes_per_rank"]
            own = _unshaped_inputs(workload, got, counted, predict(method, cluster(base), workload))
            from_run = got.get("vote_kernel_s", 0.0) > 0  # a vote: its zeros and kernels are the run's
            for rate in rates:
                model = predict(method, cluster(rate), own)
                step = measured[rate][method]["step_s"]
                rows.append(
                    {
                        "layout": f"{world_size // per_node}x{per_node}",
                        "world_size": world_size,
                        "method": method,
                        "rate": rate,
                        "bytes_crossing": model["between_bytes_per_node"],
                        "measured_crossing": counted,
                        "compute_s": own.compute_s,
                        "kernel_bytes_per_s": own.kernel_bytes_per_s,
                        "vote_inputs_from_run": from_run,
                        "zero_bits": own.zero_bits,
                        "kernel_s": 4 * own.params / own.kernel_bytes_per_s,
                        "ns_flops_per_s": own.ns_flops_per_s,
                        "latency_s": latency,
                        "predicted_s": model["step_s"],
                        "measured_s": step,
                        "ratio": model["step_s"] / step,
                    }
                )
    return rows


def _unshaped_inputs(workload: Workload, row: dict, counted: float, dense: dict) -> Workload:
    """``workload`` with what the unshaped run's ``row`` says of a method's vote: the zeros'
    bits (the bytes ``counted`` over the dense model's, less one, to two decimals, as
    ``ddp-step``'s bits per entry shows them) and the kernel throughput of its measured host
    seconds per step (``vote_kernel_s``; rows without it keep ``workload``'s)."""
    dense_bytes = dense["between_bytes_per_node"]
    zero_bits = round(max(0.0, counted / dense_bytes - 1), 2) if dense_bytes > 0 else 0.0
    kernel_s = row.get("vote_kernel_s", 0.0)
    kernels = 4 * workload.params / kernel_s if kernel_s > 0 else workload.kernel_bytes_per_s
    return dataclasses.replace(workload, zero_bits=zero_bits, kernel_bytes_per_s=kernels)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("plan", __doc__)
    parser.add_argument("--model", choices=sorted(GPT_SIZES), help="a GPT-style model (parameters and matrix shapes)")
    parser.add_argument(
        "--params", type=float, help="parameters, if not --model (matrices: none; PowerSGD and NS omitted)"
    )
    parser.add_argument("--nodes", type=positive_int, default=2)
    parser.add_argument("--ranks-per-node", type=positive_int, default=8)
    parser.add_argument("--link", default="100gbit", help="bandwidth of one NIC between nodes (tc units)")
    parser.add_argument("--nics-per-node", type=positive_int, default=None, help="default: one per rank")
    parser.add_argument("--latency-us", type=float, default=10.0, help="α between nodes, per message round")
    parser.add_argument("--intra-link", default="3600gbit", help="bandwidth inside a node per rank (NVLink)")
    parser.add_argument("--intra-latency-us", type=float, default=2.0)
    parser.add_argument("--compute-ms", type=float, help="forward+backward per step (default: 6·n·tokens / --tflops)")
    parser.add_argument("--tokens-per-rank", type=float, default=8192)
    parser.add_argument("--tflops", type=float, default=400.0, help="achieved forward+backward throughput")
    parser.add_argument("--kernel-gbps", type=float, default=1000.0, help="pack+vote+unpack, GB/s of fp32 input")
    parser.add_argument("--measure-kernels", action="store_true", help="measure the kernels on this machine's CPU")
    parser.add_argument("--ns-tflops", type=float, default=200.0, help="Newton–Schulz throughput")
    parser.add_argument("--zero-bits", type=float, default=0.0, help="extra bits per entry for the vote's zeros")
    parser.add_argument("--period", type=positive_int, default=32, help="H: local steps per round (diloco_*)")
    parser.add_argument(
        "--round-bits",
        type=float,
        default=1.0,
        help="bits per entry of a one-bit round between nodes (diloco_vote_node; 1.17 with 8-bit "
        "scales per 64 entries on 2 nodes)",
    )
    parser.add_argument("--fragments", type=positive_int, default=1, help="F: streaming rounds' fragments (diloco_*)")
    parser.add_argument("--sync-delay", type=int, default=0, help="τ: steps a streaming round travels behind")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="no communication hidden behind backward (the upper bound; default: DDP's overlap)",
    )
    parser.add_argument(
        "--backward-share", type=float, default=Workload.backward_share, help="the part of the compute that is backward"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        help="DDP's bucket_cap_mb, if given to DDP (the number of buckets; default: DDP's, a first bucket "
        "of 1 MiB, then 25 MiB each)",
    )
    parser.add_argument("--methods", nargs="+", default=list(names_for("plan")), choices=names_for("plan"))
    parser.add_argument("--projection", action="store_true", help="the published-hardware projection table")
    parser.add_argument("--plot", help="with --projection: write its plot (PNG)")
    parser.add_argument(
        "--choice", action="store_true", help="every method's step per model and link rate (docs: Choosing a method)"
    )
    parser.add_argument("--validate", action="store_true", help="predicted vs measured under netem (root)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="with --validate: passes, medians per point")
    parser.add_argument(
        "--uncrowded",
        action="store_true",
        help="with --validate: also the flat points on 2 ranks (no more ranks than a 2-core machine's cores)",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    if (args.repeats != 1 or args.uncrowded) and not args.validate:
        parser.error("--repeats and --uncrowded apply to --validate")
    if sum((args.projection, args.validate, args.choice)) > 1:
        parser.error("give one of --projection, --choice and --validate")
    if args.plot and not args.projection:
        parser.error("--plot draws the projection: give it with --projection")
    if (args.projection or args.validate or args.choice) and (args.period != 32 or args.round_bits != 1.0):
        parser.error(
            "--period and --round-bits describe a cluster you plan (--model or --params); the projection "
            "and the validation use their own settings"
        )
    overlap_inputs = args.backward_share != parser.get_default("backward_share") or args.bucket_mb is not None
    if args.validate and (args.no_overlap or overlap_inputs):
        parser.error(
            "--no-overlap, --backward-share and --bucket-mb describe a model; the validation predicts "
            "from a measured step"
        )
    if (args.projection or args.choice) and overlap_inputs:
        parser.error("the projection uses its own backward share and buckets (--no-overlap applies)")
    if not 0 <= args.backward_share <= 1:
        parser.error(f"--backward-share {args.backward_share} must lie in [0, 1]")
    if args.bucket_mb is not None and not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        parser.error(f"--bucket-mb {args.bucket_mb} must be a positive size")
    if args.projection:
        rows = projection(args.plot, overlap=not args.no_overlap)
    elif args.choice:
        rows = choice(overlap=not args.no_overlap)
    elif args.validate:
        rows = validate(
            repeats=args.repeats, layouts=VALIDATION_LAYOUTS + (UNCROWDED_LAYOUTS if args.uncrowded else ())
        )
    else:
        if (args.model is None) == (args.params is None):
            parser.error("give --model or --params (one of them)")
        if not (math.isfinite(args.round_bits) and args.round_bits >= 1):
            parser.error(f"--round-bits {args.round_bits} must be at least 1 (the signs)")
        params, matrices = model_shapes(args.model) if args.model else (int(args.params), ())
        compute = (
            args.compute_ms / 1e3
            if args.compute_ms is not None
            else 6 * params * args.tokens_per_rank / (args.tflops * 1e12)
        )
        kernel = args.kernel_gbps * 1e9
        if args.measure_kernels:
            import torch

            from signmuon.benchmarks.cost.kernels import measure

            t = measure(1 << 22, 2, torch.device("cpu"))
            kernel = 4 * (1 << 22) / (t["pack"] + t["vote"] + t["unpack"])
        try:
            cluster = Cluster(
                args.nodes,
                args.ranks_per_node,
                parse_rate(args.link),
                args.nics_per_node,
                args.latency_us * 1e-6,
                parse_rate(args.intra_link),
                args.intra_latency_us * 1e-6,
            )
        except ValueError as error:
            parser.error(str(error))
        workload = Workload(
            params,
            compute,
            matrices,
            kernel,
            args.ns_tflops * 1e12,
            args.zero_bits,
            args.period,
            args.round_bits,
            overlap=not args.no_overlap,
            backward_share=args.backward_share,
            fragments=args.fragments,
            sync_delay=args.sync_delay,
            **(
                {}
                if args.bucket_mb is None
                else dict.fromkeys(("bucket_bytes", "first_bucket_bytes"), args.bucket_mb * 2**20)
            ),
        )
        rows = plan_rows(cluster, workload, args.methods)
        print_plan(rows, cluster, workload)
    write_report("plan", argv, {"rows": rows}, args.json)
    return rows
