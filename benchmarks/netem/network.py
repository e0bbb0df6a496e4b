"""An emulated cluster network on one machine: each node (one rank, or ``ranks_per_node``) in a
network namespace of its own, joined by a bridge, its link rate limited by ``tc``. Everything
stays in namespaces this run creates, on addresses of its own (10.77.x.y inside them), and is
torn down afterwards, also on failure. Needs root and iproute2 (``ip``, ``tc``); the command
that runs benchmarks across it is ``signmuon-bench netem``."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import sys
import time

__all__ = ["EmulatedNetwork", "rate_bits"]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


_NETWORKS = itertools.count()
TBF_MIN_BURST = 8 * 1024
"""Bytes of tbf's smallest bucket. Its timer fires late on a busy machine (by about 0.1 ms
here), and a bucket of a few frames then idles the link: 33 KB a step crossed 30 Mbit/s at 3/4
of the rate with a 3 KB bucket, at 0.91 of it with 8 KiB (TCP/IP headers take 0.05)."""


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
        # 1 ms of traffic, at least TBF_MIN_BURST: a NIC's line rate. A larger bucket refills
        # while a step computes and lets a small message through at loopback speed (64 KiB would
        # carry a 1-bit vote of 500k entries free at 100 Mbit/s); tbf splits GSO segments.
        burst = max(rate_bits(self.rate) // 8 // 1000, TBF_MIN_BURST)
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

    def run(self, command_args: list[str], timeout: float, live: bool = False) -> list[subprocess.CompletedProcess]:
        """Run ``signmuon-bench <command_args...>`` as rank i in namespace i; ``live``: rank 0's
        stderr (its progress bar, its errors) goes to this process's stderr as it comes."""
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
            command = ["ip", "netns", "exec", ns, sys.executable, "-m", "signmuon.benchmarks", *command_args]
            stderr = None if live and rank == 0 else subprocess.STDOUT
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
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


def rate_bits(rate: str) -> int:
    """'1gbit' -> 10**9 bits per second (tc's units: bit, kbit, mbit, gbit)."""
    rate = rate.lower().strip()
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(suffix):
            try:
                return int(float(rate[: -len(suffix)]) * scale)
            except ValueError:
                break
    raise ValueError(f"rate={rate!r}: give it in tc's units, e.g. 1gbit, 100mbit")
