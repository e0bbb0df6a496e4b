"""What ``bandwidth`` times for each method: one call of the collective on a gradient, and the
algorithmic bytes one rank sends per call. Each builder takes ``(grad, world_size)`` and returns
``(call, bytes)``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, VoteConfig, majority_vote, node_layout, vote_bytes_per_rank
from signmuon.comm_hooks.dist import ring_bytes
from signmuon.comm_hooks.vote import NodeVoteWork
from signmuon.integrations.deepspeed import SignCompressedBackend

__all__ = [
    "allreduce",
    "bf16_allreduce",
    "ef_1bit",
    "int8_sum_allreduce",
    "node_vote",
    "powersgd",
    "vote",
]

Call = tuple[Callable[[], object], int]


def allreduce(grad: torch.Tensor, world_size: int) -> Call:
    buf = grad.clone()
    return (lambda: dist.all_reduce(buf)), ring_bytes(4 * grad.numel(), world_size)


def bf16_allreduce(grad: torch.Tensor, world_size: int) -> Call:
    buf = grad.to(torch.bfloat16)
    return (lambda: dist.all_reduce(buf)), ring_bytes(2 * grad.numel(), world_size)


def int8_sum_allreduce(grad: torch.Tensor, world_size: int) -> Call:
    """The SignMuon paper's vote: int8 signs summed by an all-reduce."""
    signs = torch.sign(grad).to(torch.int8)
    buf = signs.clone()
    return (lambda: (buf.copy_(signs), dist.all_reduce(buf))), ring_bytes(grad.numel(), world_size)


def vote(tie: str = "fast", algorithm: str = "two_phase") -> Callable[[torch.Tensor, int], Call]:
    """The majority vote with ``tie`` and ``algorithm``."""

    def build(grad: torch.Tensor, world_size: int) -> Call:
        out = torch.empty_like(grad)
        stats = CommStats()
        config = VoteConfig(tie=tie, algorithm=algorithm)
        call = lambda: majority_vote(grad, config=config, out=out, stats=stats)  # noqa: E731
        return call, vote_bytes_per_rank(grad.numel(), world_size, algorithm)

    return build


def node_vote(grad: torch.Tensor, world_size: int) -> Call:
    """Node-aware: fp32 inside the node, one bit between (``LOCAL_WORLD_SIZE`` ranks a node);
    the bytes counted are those between nodes."""
    n = grad.numel()
    layout = node_layout(None, None)
    config = VoteConfig(hierarchical=True)
    if layout.flat:
        out = torch.empty_like(grad)
        return (lambda: majority_vote(grad, config=config.rail, out=out)), vote_bytes_per_rank(n, world_size)
    buf, out = grad.clone(), torch.empty_like(grad)
    c = -(-n // layout.ranks_per_node)
    mine = min(n, (layout.local_rank + 1) * c) - min(n, layout.local_rank * c)
    call = lambda: (buf.copy_(grad), NodeVoteWork(buf, layout, config, out=out).wait())  # noqa: E731
    return call, vote_bytes_per_rank(mine, layout.nodes, agree_sizes=False)


def _matrix_shape(numel: int) -> tuple[int, int]:
    rows = max(1, int(math.sqrt(numel)))
    return rows, -(-numel // rows)


def powersgd(rank: int) -> Callable[[torch.Tensor, int], Call]:
    """PowerSGD of rank ``rank`` on the gradient as a near-square matrix: two all-reduces."""

    def build(grad: torch.Tensor, world_size: int) -> Call:
        n = grad.numel()
        rows, cols = _matrix_shape(n)
        matrix = torch.zeros(rows * cols)
        matrix[:n] = grad
        matrix = matrix.view(rows, cols)
        q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(0))

        def call():  # P = M Q, orthogonalise, Q = M^T P
            p = matrix @ q
            dist.all_reduce(p)
            p_orth, _ = torch.linalg.qr(p)
            q_new = matrix.T @ p_orth
            dist.all_reduce(q_new)
            return p_orth @ q_new.T

        return call, ring_bytes(4 * rank * (rows + cols), world_size)

    return build


def ef_1bit(grad: torch.Tensor, world_size: int) -> Call:
    """1-bit Adam's error-feedback scaled signs (``compressed_allreduce``)."""
    n = grad.numel()
    backend = SignCompressedBackend()
    padded = -(-n // (8 * world_size)) * 8 * world_size
    worker_error, server_error = torch.zeros(padded), torch.zeros(padded // world_size)
    buf = grad.clone()
    call = lambda: backend.compressed_allreduce(buf.copy_(grad), worker_error, server_error)  # noqa: E731
    chunk = padded // world_size
    return call, 2 * (world_size - 1) * (chunk // 8 + 4)
