"""An α–β model of one data-parallel step: bytes, communication time and step time per method.

Per rank and step, for a model of n parameters on N nodes of L ranks (M = N·L), with ``e``
bytes per gradient entry (4 for fp32, 2 for fp16/bf16):

==================  ===============================================  ==============================
schedule            bytes leaving a node per step                    inside a node, per rank
==================  ===============================================  ==============================
ring all-reduce     2(M-1)/M · e·n (N > 1)                            2(L-1)/L · e·n (N = 1)
two-level           2(N-1)/N · e·n (its L rails together)            2(L-1)/L · e·n
flat vote           L · 2(M-L)/M · n/8 (two-phase: all-to-all,       the rest of 2(M-1)/M · n/8
                    then all-gather)
node-aware vote     2(N-1)/N · n/8                                   2(L-1)/L · 4n + (L-1)/L · n
PowerSGD (rank r)   ring all-reduce of P and Q: Σ (rows+cols)·r      as the ring
                    entries per matrix, the rest uncompressed
==================  ===============================================  ==============================

Communication C = bytes leaving the node / (its NICs × link rate) + α · rounds between nodes +
bytes inside / intra-node rate + α_in · rounds inside. Step = compute (forward and backward,
given or measured) + the part of C that backward does not hide + the vote's kernels (pack,
vote, unpack: 4n bytes at the measured kernel throughput) + Newton–Schulz (SignMuon: 5
iterations of (4m²k + 2m³) flops per m×k matrix, m ≤ k, split over the node's L ranks in the
node-aware vote; PowerSGD: its two products per matrix); kernels and Newton–Schulz run on the
device that computes, so they never hide.

Overlap (``Workload.overlap``, on by default): DDP starts each bucket's collective when
backward has produced the bucket and runs it while backward goes on. With B buckets (DDP's:
a first of 1 MiB, then ``bucket_bytes`` of the fp32 gradient each; taken as equal), backward
time T_b and the buckets' collectives run one after another, the last one ends
max(C − T_b·(1 − 1/B), C/B) after backward: backward hides (1 − 1/B)·min(T_b, C). Off, C adds
whole: an upper bound. Never hidden: the node-aware
votes' gather of voted slices inside the node (a blocking collective the compute waits for;
their node all-reduce and rail vote are pipelined across buckets like DDP's own), and a
rounds method's round, which runs after the step (a streaming round, ``sync_delay`` τ ≥ 1: the
share ``round_hidden_share`` of it runs behind the next τ steps' compute).

The vote's bytes are the dense formula (one bit per entry); exact zeros (``zeros="abstain"``
on ReLU networks) add up to a bit per entry, which ``zero_bits`` accounts for, and where they
travel each of the vote's rounds is followed by one more (their lists, whose sizes the first
announced).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from signmuon.benchmarks.methods.registry import builder, names_for

__all__ = ["Cluster", "Workload", "compute_for", "crossover", "predict", "parse_rate", "round_hidden_share"]


def parse_rate(text: str) -> float:
    """Bits per second of ``"100mbit"``, ``"1gbit"``, ``"400gbit"``, ``"3600gbit"`` (tc's units)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"rate {text!r}: give a number with kbit, mbit, gbit or tbit (e.g. 100gbit)")


@dataclass(frozen=True)
class Cluster:
    """The machines: N nodes of L ranks and their links."""

    nodes: int
    """N, the number of nodes."""
    ranks_per_node: int
    """L, ranks (GPUs) per node."""
    link_bps: float
    """Bandwidth of one NIC between nodes, bits per second."""
    nics_per_node: int | None = None
    """NICs a node's traffic leaves by (None: one per rank, a rail-optimised cluster)."""
    latency_s: float = 10e-6
    """α between nodes: seconds per message round."""
    intra_bps: float = 3.6e12
    """Bandwidth inside a node per rank (NVLink: about 450 GB/s)."""
    intra_latency_s: float = 2e-6
    """α inside a node."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes={self.nodes} and ranks_per_node={self.ranks_per_node} must be >= 1")
        if not (self.link_bps > 0 and self.intra_bps > 0):
            raise ValueError("link rates must be > 0")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def node_bps(self) -> float:
        """Bandwidth out of a node: its NICs together."""
        return self.link_bps * (self.nics_per_node or self.ranks_per_node)


@dataclass(frozen=True)
class Workload:
    """What one rank computes per step."""

    params: int
    """n, parameters (gradient entries)."""
    compute_s: float
    """Forward and backward of one step on one rank, seconds."""
    matrices: tuple[tuple[int, int], ...] = ()
    """Shapes of the hidden matrices (SignMuon's Newton–Schulz, PowerSGD's compression); the
    rest of n (vectors, embeddings and head, on Signum's path as Muon users route them) is not."""
    kernel_bytes_per_s: float = 20e9
    """Throughput of pack + vote + unpack on the fp32 gradient (bytes of input per second)."""
    ns_flops_per_s: float = 50e12
    """Newton–Schulz's matrix-multiply throughput (float32)."""
    zero_bits: float = 0.0
    """Extra bits per entry the vote's zeros cost (0: dense; up to 1 with abstention on ReLU nets)."""
    period: int = 32
    """H, local steps per round of the rounds methods (``diloco_node``, ``diloco_vote_node``): their
    round's cost is spread over H steps. How many more steps rounds need to reach a loss is not
    modelled (measure it: ``train``)."""
    round_bits: float = 1.0
    """Bits per entry of a one-bit round (``diloco_vote_node``) between nodes: 1 for the signs
    alone, more with block scales (``OuterStep.scale_block``, ``scale_bits``) or exact ties."""
    overlap: bool = True
    """Whether backward hides communication as DDP overlaps them (see the module's docstring);
    False: communication after compute, the upper bound."""
    backward_share: float = 2 / 3
    """The part of ``compute_s`` that is backward (about twice the forward's flops)."""
    bucket_bytes: float = 25 * 2**20
    """DDP's bucket size over the fp32 gradient (``bucket_cap_mb=25``): it sets the number of buckets."""
    first_bucket_bytes: float = 2**20
    """DDP's first bucket (the last layers' gradients, ready first): 1 MiB where ``bucket_cap_mb``
    is left at its default (``dist._DEFAULT_FIRST_BUCKET_BYTES``), else ``bucket_bytes``."""
    extra: dict = field(default_factory=dict)
    """Free-form notes carried to the report."""
    fragments: int = 1
    """F, streaming rounds' fragments (``diloco_*``): a round of 1/F of the model every H/F steps."""
    sync_delay: int = 0
    """τ, the inner steps a streaming round travels behind: it hides min(1, τ·compute / its wire
    time) of the round (``round_hidden_share``); 0: the round after the step, nothing hidden."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.backward_share <= 1.0:
            raise ValueError(f"backward_share={self.backward_share} must lie in [0, 1]")
        if not (self.bucket_bytes > 0 and self.first_bucket_bytes > 0):
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes} and first_bucket_bytes={self.first_bucket_bytes} must be > 0"
            )

    @property
    def buckets(self) -> int:
        """B, DDP's buckets of the fp32 gradient: the first, then ``bucket_bytes`` each (DDP never
        splits a parameter, so parameters large against the caps make fewer, larger buckets)."""
        rest = 4 * self.params - self.first_bucket_bytes
        return 1 + max(0, math.ceil(rest / self.bucket_bytes))

    def hidden_seconds(self, comm_s: float) -> float:
        """How much of ``comm_s`` of bucketed collectives backward hides: (1 − 1/B)·min(T_b, C)."""
        if not self.overlap:
            return 0.0
        return (1 - 1 / self.buckets) * min(self.backward_share * self.compute_s, comm_s)


def predict(method: str, cluster: Cluster, workload: Workload) -> dict[str, float]:
    """Bytes leaving a node, bytes inside a node per rank, communication and step seconds of
    ``method`` (its traffic is the registry's ``plan`` builder: ``names_for("plan")``)."""
    try:
        traffic = builder(method, "plan")(cluster, workload)
    except ValueError:
        raise ValueError(f"plan has no model of {method!r}; it models {names_for('plan')}") from None
    between, inside, rounds, rounds_in, blocking, extra_s = traffic
    bucketed_s = _link_seconds(cluster, between, inside, rounds, rounds_in)
    blocking_s = _link_seconds(cluster, *blocking)
    hidden = workload.hidden_seconds(bucketed_s)
    share = round_hidden_share(blocking_s, workload) if method.startswith("diloco") else 0.0
    exposed = bucketed_s - hidden + blocking_s * (1.0 - share)
    return {
        "round_hidden_share": share,
        "between_bytes_per_node": between + blocking[0],
        "inside_bytes_per_rank": inside + blocking[1],
        "comm_s": bucketed_s + blocking_s,
        "exposed_comm_s": exposed,
        "extra_s": extra_s,
        "step_s": workload.compute_s + exposed + extra_s,
    }


def round_hidden_share(round_s_per_step: float, workload: Workload) -> float:
    """The share of a streaming round's wire time the next τ inner steps hide: a fragment's round
    (1/F of the model; per step ``round_s_per_step``, whole rounds every H steps) takes
    ``round_s_per_step``·H/F and stays in flight beside τ steps of compute."""
    if workload.sync_delay <= 0 or round_s_per_step <= 0.0:
        return 0.0
    wire = round_s_per_step * workload.period / workload.fragments
    return min(1.0, workload.sync_delay * workload.compute_s / wire)


def _link_seconds(cluster: Cluster, between: float, inside: float, rounds: float, rounds_in: float) -> float:
    """The α–β time of bytes leaving a node, bytes inside it per rank, and their message rounds."""
    return (
        8 * between / cluster.node_bps
        + rounds * cluster.latency_s
        + 8 * inside / cluster.intra_bps
        + rounds_in * cluster.intra_latency_s
    )


def compute_for(method: str, cluster: Cluster, workload: Workload, step_s: float) -> float:
    """The compute time at which ``method``'s predicted step on ``cluster`` is ``step_s`` (a
    measured step), ``workload`` otherwise: what a step leaves after the communication backward
    does not hide and the kernels; 0 where no compute at all already predicts a longer step.
    Backward hides more as compute grows, so a measured step less the communication alone would
    undercount it; the step grows with compute, and bisection finds it."""

    def step(compute: float) -> float:
        return predict(method, cluster, dataclasses.replace(workload, compute_s=compute))["step_s"]

    if step(0.0) >= step_s:
        return 0.0
    low, high = 0.0, step_s  # step(step_s) >= step_s: backward hides no more than the communication
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < step_s else (low, mid)
    return (low + high) / 2


def crossover(method: str, cluster: Cluster, workload: Workload, baseline: str = "allreduce") -> float | None:
    """The link rate (bits/s per NIC) below which ``method``'s step is faster than ``baseline``'s;
    ``math.inf`` if it is faster at every rate, None if at none."""

    def at(rate: float) -> float:
        other = Cluster(**{**cluster.__dict__, "link_bps": rate})
        return predict(method, other, workload)["step_s"] - predict(baseline, other, workload)["step_s"]

    low, high = 1e3, 1e15
    if at(high) < 0:
        return math.inf
    if at(low) >= 0:
        return None
    for _ in range(200):  # bisection on a log scale
        mid = math.sqrt(low * high)
        low, high = (mid, high) if at(mid) < 0 else (low, mid)
    return high
