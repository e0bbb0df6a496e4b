"""What each method sends per step, for the cost model (``plan``): a :class:`Traffic` from a
cluster and a workload (``benchmarks.cost.model``'s ``Cluster`` and ``Workload``). The schedules
and formulas are in that module's docstring."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Traffic", "allreduce", "hsdp", "node_allreduce", "node_vote", "rounds", "sharded_vote", "vote"]


class Traffic(NamedTuple):
    """Bytes and message rounds of one step."""

    between: float = 0.0
    """Bytes leaving a node in collectives backward may hide (bucketed)."""
    inside: float = 0.0
    """Bytes inside a node per rank, likewise."""
    rounds: float = 0.0
    """Message rounds between nodes."""
    rounds_in: float = 0.0
    """Message rounds inside a node."""
    blocking: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """(between, inside, rounds, rounds_in) that backward never hides: a round after the step, or
    a collective the compute waits for (a blocking one in the hook)."""
    extra_s: float = 0.0
    """Seconds of work on the computing device: kernels, Newton–Schulz, PowerSGD's products."""


def _ring(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def _ns_flops(matrices) -> float:
    total = 0.0
    for rows, cols in matrices:
        m, k = min(rows, cols), max(rows, cols)
        total += 5 * (4 * m * m * k + 2 * m**3)
    return total


def _powersgd_entries(workload, rank: int) -> float:
    compressed = sum(r * c for r, c in workload.matrices)
    return sum((r + c) * rank for r, c in workload.matrices) + (workload.params - compressed)


def allreduce(bytes_per_entry: int = 4, powersgd_rank: int = 0) -> Callable[..., Traffic]:
    """A ring all-reduce over every rank (of PowerSGD's P and Q where ``powersgd_rank``)."""

    def traffic(cluster, workload) -> Traffic:
        N, L, M, n = cluster.nodes, cluster.ranks_per_node, cluster.world_size, workload.params
        entries, extra_s = n, 0.0
        if powersgd_rank:  # P = G Q and Q = Gᵀ P per matrix, and the error feedback
            entries = _powersgd_entries(workload, powersgd_rank)
            extra_s = sum(4 * r * c * 4 + 2 * r * c for r, c in workload.matrices) / workload.ns_flops_per_s
        nbytes = entries * bytes_per_entry
        if N > 1:
            return Traffic(between=_ring(nbytes, M), rounds=2 * (M - 1), extra_s=extra_s)
        return Traffic(inside=_ring(nbytes, L), rounds_in=2 * (L - 1), extra_s=extra_s)

    return traffic


def node_allreduce(cluster, workload) -> Traffic:
    """The two-level all-reduce: inside the node, then over the rails."""
    N, L, n = cluster.nodes, cluster.ranks_per_node, workload.params
    return Traffic(_ring(4 * n, N), _ring(4 * n, L), 2 * (N - 1), 2 * (L - 1))


def _zero_rounds(workload, rounds: float) -> float:
    """A vote's message rounds: each is followed by the exchange of the zeros' lists where zeros
    travel (``workload.zero_bits`` > 0), whose sizes the first one announced."""
    return 2 * rounds if workload.zero_bits > 0 else rounds


def vote(newton_schulz: bool = False) -> Callable[..., Traffic]:
    """The flat vote (two-phase); with ``newton_schulz``, SignMuon's."""

    def traffic(cluster, workload) -> Traffic:
        N, L, M, n = cluster.nodes, cluster.ranks_per_node, cluster.world_size, workload.params
        bits = 1.0 + workload.zero_bits
        per_rank = 2 * (M - 1) / M * n * bits / 8 if M > 1 else 0.0
        share = (M - L) / (M - 1) if M > 1 else 0.0  # of each rank's sends, the part to other nodes
        rounds, rounds_in = (2 * (M - 1), 0) if N > 1 else (0, 2 * (L - 1))
        rounds, rounds_in = _zero_rounds(workload, rounds), _zero_rounds(workload, rounds_in)
        extra_s = 4 * n / workload.kernel_bytes_per_s
        if newton_schulz:
            extra_s += _ns_flops(workload.matrices) / workload.ns_flops_per_s
        return Traffic(L * per_rank * share, per_rank * (1 - share), rounds, rounds_in, extra_s=extra_s)

    return traffic


def node_vote(newton_schulz: bool = False) -> Callable[..., Traffic]:
    """The node-aware vote: fp32 inside the node, one bit between; Newton–Schulz split over L."""

    def traffic(cluster, workload) -> Traffic:
        N, L, n = cluster.nodes, cluster.ranks_per_node, workload.params
        bits = 1.0 + workload.zero_bits
        between, rounds = (2 * (N - 1) / N * n * bits / 8 if N > 1 else 0.0), _zero_rounds(workload, 2 * (N - 1))
        blocking = (0.0, (L - 1) / L * n, 0.0, L - 1)  # the voted slices' gather: the compute waits for it
        extra_s = 4 * n / L / workload.kernel_bytes_per_s
        if newton_schulz:
            extra_s += _ns_flops(workload.matrices) / L / workload.ns_flops_per_s
        return Traffic(between, _ring(4 * n, L), rounds, 2 * (L - 1), blocking, extra_s)

    return traffic


def rounds(one_bit: bool = False) -> Callable[..., Traffic]:
    """Node-aware rounds: the node's all-reduce every step, a round every ``workload.period``
    steps, of fp32 pseudo-gradients or ``workload.round_bits`` per entry."""

    def traffic(cluster, workload) -> Traffic:
        N, L, n = cluster.nodes, cluster.ranks_per_node, workload.params
        H = workload.period
        per_round = n * workload.round_bits / 8 if one_bit else 4 * n  # the node's rails, in all
        blocking = (2 * (N - 1) / N * per_round / H, (L - 1) / L * 4 * n / H, 2 * (N - 1) / H, (L - 1) / H)
        return Traffic(inside=_ring(4 * n, L), rounds_in=2 * (L - 1), blocking=blocking)

    return traffic


def _fsdp_inside(cluster, workload) -> float:
    """FSDP2's own bytes per rank inside the node: the gradient's fp32 reduce-scatter and the
    parameters' all-gathers in forward and backward (16-bit compute)."""
    L, n = cluster.ranks_per_node, workload.params
    return (L - 1) / L * (4 * n + 2 * 2 * n)


def hsdp(cluster, workload) -> Traffic:
    """FSDP2 inside each node, its shards' fp32 all-reduce between nodes on the rails (HSDP);
    FSDP2 runs it per unit during backward."""
    N, L, n = cluster.nodes, cluster.ranks_per_node, workload.params
    return Traffic(_ring(4 * n, N), _fsdp_inside(cluster, workload), 2 * (N - 1), 3 * (L - 1))


def sharded_vote(newton_schulz: bool = False, during_backward: bool = True) -> Callable[..., Traffic]:
    """``register_fsdp_vote``: FSDP2 inside each node, each rank's shard voted on its rail, one
    bit per entry; SignMuon sends each matrix's direction shards to its owner and the voted signs
    back (one byte each), Newton–Schulz split over L. During backward the vote runs per unit like
    DDP's buckets; in ``step()`` (``during_backward=False``) nothing of it is hidden."""

    def traffic(cluster, workload) -> Traffic:
        N, L, n = cluster.nodes, cluster.ranks_per_node, workload.params
        between = 2 * (N - 1) / N * n * (1.0 + workload.zero_bits) / 8 if N > 1 else 0.0
        owned = sum(r * c for r, c in workload.matrices) if newton_schulz else 0
        inside = (L - 1) / L * (4 + 1) * owned  # directions to owners, signs back
        extra_s = 4 * n / L / workload.kernel_bytes_per_s
        if newton_schulz:
            extra_s += _ns_flops(workload.matrices) / L / workload.ns_flops_per_s
        vote = (between, inside, _zero_rounds(workload, 2 * (N - 1)), 2 * (L - 1) if owned else 0)
        fsdp = Traffic(0.0, _fsdp_inside(cluster, workload), 0, 3 * (L - 1))
        if during_backward:
            return Traffic(vote[0], fsdp.inside + vote[1], vote[2], fsdp.rounds_in + vote[3], extra_s=extra_s)
        return fsdp._replace(blocking=vote, extra_s=extra_s)

    return traffic
