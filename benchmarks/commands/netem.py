"""An emulated cluster network on one machine: each rank in its own network namespace.

M namespaces, each with a veth pair whose other end hangs on one bridge; ``tc netem`` on
each rank's interface limits its rate and adds delay (e.g. 1 Gbit/s, 0.2 ms), so a
benchmark run across them sees a real, slow network instead of loopback. The harness runs
any torchrun-aware benchmark module in every namespace (rank 0 holds the rendezvous store),
reads the interfaces' byte counters before and after, and reports the bytes really sent
beside the algorithmic count. Everything stays in namespaces this run creates, on
addresses of its own (10.77.x.y inside them), and is torn down afterwards, also on failure.
Needs root and iproute2 (``ip``, ``tc``).

    signmuon-bench netem --world-size 4 --rate 1gbit --delay 0.2ms -- bandwidth --sizes 1M 16M

``--ranks-per-node L`` groups L ranks into one namespace, a "node": they talk over its
loopback, unshaped, and only traffic between nodes crosses the shaped links, whose counters
then give the bytes that crossed between nodes (e.g. for the node-aware vote)::

    signmuon-bench netem --world-size 4 --ranks-per-node 2 --rate 1gbit -- ddp-step --methods signsgd_mv signsgd_mv_node

``--rates`` runs the command once per rate. With ``train`` it prints the wall time to the target
loss per method and rate and ``--plot`` draws test loss against wall time, one panel per rate::

    signmuon-bench netem --world-size 4 --rates 100mbit 1gbit 10gbit --plot rates.png -- \
        train --task charlm --size medium --methods adamw signmuon --seeds 0 1 2
"""

from __future__ import annotations

import os
import sys
import tempfile

from signmuon.benchmarks.commands import COMMANDS
from signmuon.benchmarks.netem.network import EmulatedNetwork, rate_bits
from signmuon.benchmarks.reports.rates import plot_rates, print_time_to_target
from signmuon.benchmarks.reports.writer import read_report, write_report
from signmuon.benchmarks.runtime.cli import command_parser

NAME = "netem"
SUMMARY = "run a benchmark across network namespaces with tc-limited links (root, iproute2)"


__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        argv = argv + ["--", "bandwidth", "--sizes", "64K", "1M", "--methods", "allreduce", "signsgd_mv_exact"]
    split = argv.index("--")
    parser = command_parser("netem", __doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks sharing a namespace (a node: loopback inside, shaped links between)",
    )
    parser.add_argument("--rate", default="1gbit", help="tc rate per rank, e.g. 1gbit, 10gbit")
    parser.add_argument("--rates", nargs="+", help="run the command once per rate (overrides --rate)")
    parser.add_argument("--delay", default="0.2ms", help="tc delay per packet, e.g. 0.2ms ('' for none)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--plot", help="with train: test loss against wall time, one panel per rate (PNG)")
    parser.add_argument("--json", help="write the report of every rate here")
    parser.add_argument("--live", action="store_true", help="rank 0's progress bar and errors as they come")
    parser.add_argument("--quiet", action="store_true", help="not rank 0's output nor the counters (the report only)")
    args = parser.parse_args(argv[:split])
    inner = argv[split + 1 :]
    if not inner or inner[0] not in COMMANDS or inner[0] in ("netem", "demo"):
        parser.error(f"after '--' give the benchmark to run, one of {', '.join(c for c in COMMANDS if c != 'netem')}")
    rates = args.rates or [args.rate]
    for rate in rates:
        try:
            rate_bits(rate)
        except ValueError as error:
            parser.error(str(error))
    if args.plot and inner[:1] != ["train"]:
        parser.error("--plot draws training curves: give it with '-- train ...'")
    reports = [_run_once(args, inner, rate) for rate in rates]
    if inner[0] == "train" and not args.quiet:
        print_time_to_target(reports)
        if args.plot:
            plot_rates(reports, args.plot)
            print(f"wrote {os.path.abspath(args.plot)}")
    write_report("netem", argv, {"reports": reports}, args.json)
    return reports[0] if len(reports) == 1 else {"reports": reports}


def _run_once(args, inner: list[str], rate: str) -> dict:
    """The inner command across namespaces at one rate; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "rows.json")
        if inner[0] in ("bandwidth", "train") and "--json" not in inner:
            inner = inner + ["--json", json_path] + ([] if args.live else ["--no-progress"])
        elif inner[0] in ("ddp-step", "deepspeed-step") and "--json" not in inner:
            inner = inner + ["--json", json_path]
        with EmulatedNetwork(args.world_size, rate, args.delay, ranks_per_node=args.ranks_per_node) as net:
            before = net.tx_bytes()
            results = net.run(inner, args.timeout, live=args.live)
            sent = [after - b for after, b in zip(net.tx_bytes(), before)]
        for rank, result in enumerate(results):
            if result.returncode:
                raise RuntimeError(f"rank {rank} failed in its namespace:\n{result.stdout[-3000:]}")
        if not args.quiet:
            print(results[0].stdout)
        delay = "" if net.delay_dropped else args.delay
        L = args.ranks_per_node
        unit = "node" if L > 1 else "rank"
        report = {
            "world_size": args.world_size,
            "ranks_per_node": L,
            "rate": rate,
            "delay": delay,
            f"tx_bytes_per_{unit}": sent,
        }
        if os.path.exists(json_path):
            loaded = read_report(json_path)
            if inner[0] == "train":
                report["train"] = loaded
            elif inner[0] == "ddp-step":
                # The vote's bytes between nodes, every call of the run, as the optimizer or hook counted them.
                rows = loaded["rows"]
                counted = [
                    r["between_nodes_bytes_per_node_all_calls"]
                    for r in rows
                    if "between_nodes_bytes_per_node_all_calls" in r
                ]
                if counted and L > 1:
                    report[f"algorithmic_bytes_per_{unit}"] = sum(counted)
                report["rows"] = rows
            elif inner[0] == "deepspeed-step":
                report["rows"] = loaded["rows"]  # each row's bytes between nodes from the counters
            else:
                warmup_iters = _calls_per_measurement(inner)
                # Rows carry rank 0's bytes; a node's ranks send equal shares (between nodes, for signsgd_mv_node).
                report[f"algorithmic_bytes_per_{unit}"] = L * sum(
                    r["bytes_per_rank"] * warmup_iters for r in loaded["rows"] if "bytes_per_rank" in r
                )
                report["rows"] = loaded["rows"]
        if not args.quiet:
            print(f"rate={rate} delay={delay or '0'}: bytes really sent per {unit} (veth tx) {sent}")
        if f"algorithmic_bytes_per_{unit}" in report and not args.quiet:
            print(
                f"algorithmic bytes per {unit} of the measured calls: {report[f'algorithmic_bytes_per_{unit}']} "
                "(plus barriers, timing all-reduces, rendezvous and TCP/IP headers)"
            )
        return report


def _calls_per_measurement(inner: list[str]) -> int:
    """warmup + iters of a bandwidth run (its defaults unless given)."""

    def value(flag: str, default: int) -> int:
        return int(inner[inner.index(flag) + 1]) if flag in inner else default

    return value("--warmup", 2) + value("--iters", 10)
