"""Hooks and sharding the methods' builders share: torch's PowerSGD hook with its bytes counted
(and on gloo one bucket at a time), FSDP2 per block, and FSDP2's own traffic."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from signmuon.comm_hooks import CommStats

__all__ = ["counted_powersgd_hook", "fsdp_traffic", "serial_powersgd_hook", "shard_blocks"]


def _powersgd_bytes(bucket: dist.GradBucket, rank: int, world_size: int, min_compression_rate: float = 2.0) -> int:
    """Ring bytes of torch's PowerSGD for one bucket: P and Q for the matrices it compresses,
    the raw values of the tensors it does not (its own ``_should_compress`` rule)."""
    elements = 0
    for g in bucket.gradients():
        matrix = g.reshape(g.shape[0], -1) if g.dim() > 1 else None
        if matrix is not None and matrix.numel() >= (sum(matrix.shape) * rank) * min_compression_rate:
            elements += sum(matrix.shape) * rank
        else:
            elements += g.numel()
    return 2 * (world_size - 1) * elements * 4 // world_size


def serial_powersgd_hook(state, bucket):  # unannotated: DDP checks annotations as objects
    """torch's ``powerSGD_hook``, finished before the next bucket starts.

    Its hook issues the all-reduces of P and Q from future callbacks. gloo pairs collectives by
    the order each rank issues them, so with two buckets in flight one rank's Q all-reduce can
    pair with another rank's next bucket (gloo aborts: "collective mismatch"). Waiting for each
    bucket's future in the hook keeps one order on every rank, at the cost of overlapping
    buckets; NCCL, which orders collectives per stream, needs no such wait.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    result = powerSGD_hook.powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(result)
    return done


def counted_powersgd_hook(rank: int, stats: CommStats):
    """torch's PowerSGD hook (on gloo :func:`serial_powersgd_hook`) adding each bucket's ring
    bytes to ``stats`` (the uncompressed all-reduce until ``start_powerSGD_iter``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    world_size = dist.get_world_size()

    def hook(state, bucket):  # unannotated: DDP checks annotations as objects
        compressed = state.iter >= state.start_powerSGD_iter
        nbytes = (
            _powersgd_bytes(bucket, rank, world_size)
            if compressed
            else (2 * (world_size - 1) * bucket.buffer().numel() * 4 // world_size)
        )
        stats.add(nbytes, nbytes)
        if dist.get_backend() == "gloo":
            return serial_powersgd_hook(state, bucket)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    return hook


def shard_blocks(net: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` over ``mesh`` per block (each entry of the network's ``ModuleList``s, or
    each layer with parameters of a top-level ``nn.Sequential``), then the root, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    blocks = [block for modules in net.modules() if isinstance(modules, nn.ModuleList) for block in modules]
    if not blocks and isinstance(net, nn.Sequential):
        blocks = [layer for layer in net if any(True for _ in layer.parameters())]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def fsdp_traffic(numel: int, ranks: int) -> int:
    """Bytes one rank sends per step in FSDP2's own collectives on ``ranks`` ranks, fp32: the
    reduce-scatter of the gradients and two all-gathers of the parameters (forward, and backward
    after resharding)."""
    return 3 * (ranks - 1) * numel * 4 // ranks
