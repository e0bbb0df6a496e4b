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

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from signmuon.benchmarks.__main__ import COMMANDS
from signmuon.benchmarks.cli import command_parser

__all__ = ["EmulatedNetwork", "main"]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


_NETWORKS = itertools.count()


class EmulatedNetwork:
    """Namespaces ``<prefix>r<i>`` joined by bridge ``<prefix>br``; a context manager that cleans up."""

    def __init__(
        self, world_size: int, rate: str, delay: str, subnet: int | None = None, ranks_per_node: int = 1
    ) -> None:
        if world_size < 1 or world_size > 200:
            raise ValueError(f"world_size={world_size} must be in 1..200")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide world_size={world_size}")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the emulated network needs iproute2's `{tool}` (apt-get install iproute2)")
        self.world_size, self.rate, self.delay = world_size, rate, delay
        # Unique per network: the kernel deletes a namespace's veth pair lazily, so the next rate's
        # network must not reuse the names.
        self.prefix = f"sm{os.getpid() % 100000}{next(_NETWORKS)}"
        self.subnet = random.randrange(1, 250) if subnet is None else subnet
        self.ranks_per_node = ranks_per_node
        # One namespace per node: its ranks talk over loopback, nodes over the shaped veth links.
        self.namespaces = [f"{self.prefix}r{i}" for i in range(world_size // ranks_per_node)]
        self.bridge = f"{self.prefix}br"
        self.delay_dropped = False  # set when the kernel cannot add delay (no sch_netem)

    def address(self, rank: int) -> str:
        return f"10.77.{self.subnet}.{rank + 1}"

    def __enter__(self) -> EmulatedNetwork:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for rank, ns in enumerate(self.namespaces):
                host, inner = f"{self.prefix}h{rank}", f"{self.prefix}n{rank}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", host, "master", self.bridge)
                _run("ip", "link", "set", host, "up")
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(ns)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, ns: str) -> None:
        """netem (rate and delay); where the kernel lacks sch_netem, tbf (rate only)."""
        qdisc = ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root"]
        netem = _run(*qdisc, "netem", "rate", self.rate, *(["delay", self.delay] if self.delay else []), check=False)
        if netem.returncode == 0:
            return
        burst = max(_bits(self.rate) // 8 // 100, 32 * 1024)  # 10 ms of traffic
        _run(*qdisc, "tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms")
        if self.delay and not self.delay_dropped:
            print(
                f"note: this kernel has no sch_netem; rate {self.rate} via tbf, delay {self.delay} not applied",
                file=sys.stderr,
            )
        self.delay_dropped = True

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (which deletes its veth and the peer) and the bridge."""
        for rank, ns in enumerate(self.namespaces):
            _run("ip", "link", "del", f"{self.prefix}h{rank}", check=False)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def tx_bytes(self) -> list[int]:
        """Bytes each node's interface has sent so far (a node: one rank unless ranks_per_node > 1)."""
        return [
            int(_run("ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes").stdout)
            for ns in self.namespaces
        ]

    def run(self, module_args: list[str], timeout: float) -> list[subprocess.CompletedProcess]:
        """Run ``python -m signmuon.benchmarks.<module_args...>`` as rank i in namespace i."""
        port = str(random.randrange(20000, 60000))  # inside our own namespaces: nothing else listens
        procs = []
        L = self.ranks_per_node
        for rank in range(self.world_size):
            ns = self.namespaces[rank // L]
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank % L),
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(L),
                GROUP_RANK=str(rank // L),
                MASTER_ADDR=self.address(0),
                MASTER_PORT=port,
                GLOO_SOCKET_IFNAME="eth0",
                OMP_NUM_THREADS="1",
                SIGNMUON_NETEM_RATE=self.rate,
            )
            module = COMMANDS.get(module_args[0], module_args[0])  # a CLI name (ddp-step) or a module
            command = ["ip", "netns", "exec", ns, sys.executable, "-m", f"signmuon.benchmarks.{module}"]
            procs.append(
                subprocess.Popen(
                    command + module_args[1:], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        deadline = time.monotonic() + timeout
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"the emulated-network run did not finish in {timeout:.0f} s") from None
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
        return results


def _bits(rate: str) -> int:
    """'1gbit' -> 10**9 bits per second (tc's units: bit, kbit, mbit, gbit)."""
    rate = rate.lower().strip()
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(suffix):
            try:
                return int(float(rate[: -len(suffix)]) * scale)
            except ValueError:
                break
    raise ValueError(f"rate={rate!r}: give it in tc's units, e.g. 1gbit, 100mbit")


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
    args = parser.parse_args(argv[:split])
    inner = argv[split + 1 :]
    rates = args.rates or [args.rate]
    for rate in rates:
        try:
            _bits(rate)
        except ValueError as error:
            parser.error(str(error))
    if args.plot and inner[:1] != ["train"]:
        parser.error("--plot draws training curves: give it with '-- train ...'")
    reports = [_run_once(args, inner, rate) for rate in rates]
    if inner[0] == "train":
        print_time_to_target(reports)
        if args.plot:
            plot_rates(reports, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "signmuon-bench netem " + " ".join(argv), "reports": reports}, f, indent=1)
    return reports[0] if len(reports) == 1 else {"reports": reports}


def _run_once(args, inner: list[str], rate: str) -> dict:
    """The inner command across namespaces at one rate; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "rows.json")
        if inner[0] in ("bandwidth", "train") and "--json" not in inner:
            inner = inner + ["--json", json_path, "--no-progress"]
        elif inner[0] == "ddp-step" and "--json" not in inner:
            inner = inner + ["--json", json_path]
        with EmulatedNetwork(args.world_size, rate, args.delay, ranks_per_node=args.ranks_per_node) as net:
            before = net.tx_bytes()
            results = net.run(inner, args.timeout)
            sent = [after - b for after, b in zip(net.tx_bytes(), before)]
        for rank, result in enumerate(results):
            if result.returncode:
                raise RuntimeError(f"rank {rank} failed in its namespace:\n{result.stdout[-3000:]}")
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
            with open(json_path) as f:
                loaded = json.load(f)
            if inner[0] == "train":
                report["train"] = loaded
            elif inner[0] == "ddp-step":
                # The vote's bytes between nodes, every call of the run, as the optimizer or hook counted them.
                counted = [
                    r["between_nodes_bytes_per_node_all_calls"]
                    for r in loaded
                    if "between_nodes_bytes_per_node_all_calls" in r
                ]
                if counted and L > 1:
                    report[f"algorithmic_bytes_per_{unit}"] = sum(counted)
                report["rows"] = loaded
            else:
                warmup_iters = _calls_per_measurement(inner)
                # Rows carry rank 0's bytes; a node's ranks send equal shares (between nodes, for signsgd_mv_node).
                report[f"algorithmic_bytes_per_{unit}"] = L * sum(
                    r["bytes_per_rank"] * warmup_iters for r in loaded if "bytes_per_rank" in r
                )
                report["rows"] = loaded
        print(f"rate={rate} delay={delay or '0'}: bytes really sent per {unit} (veth tx) {sent}")
        if f"algorithmic_bytes_per_{unit}" in report:
            print(
                f"algorithmic bytes per {unit} of the measured calls: {report[f'algorithmic_bytes_per_{unit}']} "
                "(plus barriers, timing all-reduces, rendezvous and TCP/IP headers)"
            )
        return report


def print_time_to_target(reports: list[dict]) -> None:
    """Train runs at several rates: per method and rate, the wall time (mean over seeds) to the
    target loss, the seeds that reached it and, where adamw ran, the ratio to adamw's time at the
    same rate; '-' where no seed reached it."""
    trains = [r for r in reports if "train" in r]
    if not trains:
        return
    methods = list(trains[0]["train"]["summary"])
    first = trains[0]["train"]["runs"][0]
    print(
        f"time to target, s (task={first['task']}, world_size={first['world_size']}; target: each rate's own, "
        "adamw's final loss unless --target-loss)"
    )
    print(f"{'method':>16} " + " ".join(f"{r['rate']:>23}" for r in trains))
    for method in methods:
        cells = []
        for r in trains:
            summary = r["train"]["summary"].get(method, {})
            t = summary.get("time_to_target")
            adamw = r["train"]["summary"].get("adamw", {}).get("time_to_target")
            ratio = f" {t[0] / adamw[0]:.2f}x" if t and adamw and adamw[0] > 0 else ""
            cells.append(f"{t[0]:.1f} ({summary['reached']}/{summary['seeds']}){ratio}" if t else "-")
        print(f"{method:>16} " + " ".join(f"{c:>23}" for c in cells))


def plot_rates(reports: list[dict], path: str) -> None:
    """Test loss against wall time, one panel per rate, one line (mean, ±1 std band) per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trains = [r for r in reports if "train" in r]
    fig, axes = plt.subplots(1, len(trains), figsize=(4.6 * len(trains), 4.2), sharey=True, squeeze=False)
    for ax, report in zip(axes[0], trains):
        for method, summary in report["train"]["summary"].items():
            curve = summary["curve"]
            line = ax.plot(curve["time_s"], curve["mean"], marker=".", label=method)[0]
            if summary["seeds"] > 1:
                lower = [m - d for m, d in zip(curve["mean"], curve["std"])]
                upper = [m + d for m, d in zip(curve["mean"], curve["std"])]
                ax.fill_between(curve["time_s"], lower, upper, color=line.get_color(), alpha=0.2)
        target = report["train"].get("target_loss")
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{report['rate']}")
        ax.set_xlabel("wall time, s")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("test loss")
    axes[0][0].legend(fontsize=8)
    first = trains[0]["train"]["runs"][0]
    fig.suptitle(
        f"{first['task']}, {first['world_size']} ranks: test loss against wall time by link rate (dashed: target)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.abspath(path)}")


def _calls_per_measurement(inner: list[str]) -> int:
    """warmup + iters of a bandwidth run (its defaults unless given)."""

    def value(flag: str, default: int) -> int:
        return int(inner[inner.index(flag) + 1]) if flag in inner else default

    return value("--warmup", 2) + value("--iters", 10)


if __name__ == "__main__":
    main()
