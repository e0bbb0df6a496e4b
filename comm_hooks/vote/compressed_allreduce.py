"""The all-reduce of error-feedback scaled signs (1-bit Adam's compression): the DeepSpeed
backend's ``compressed_allreduce`` and the ``"scaled_sign"`` rounds, the
:class:`~signmuon.comm_hooks.vote.encodings.ScaledSignEncoding` moved by the transport."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..dist import CommStats, group_size_rank
from ..kernels import kernels_for
from .encodings import ScaledSignEncoding, error_buffer_sizes
from .transport import TransportWork

__all__ = ["scaled_sign_allreduce", "scaled_sign_allreduce_start"]


def scaled_sign_allreduce(*args, **options) -> torch.Tensor:
    """Average ``tensor`` over ``group`` at one bit per entry with error feedback, in place:
    :func:`scaled_sign_allreduce_start`'s arguments, waited for."""
    work, finish = scaled_sign_allreduce_start(*args, **options)
    return finish()


def scaled_sign_allreduce_start(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    kernels: str = "auto",
    nonfinite: str = "skip",
    stats: CommStats | None = None,
    label: str = "scaled_sign_allreduce",
    agree_sizes: bool = True,
) -> tuple[TransportWork, Callable[[], torch.Tensor]]:
    """Start averaging ``tensor`` over ``group`` at one bit per entry with error feedback, in
    place: the transport in flight, and the call that waits for it and writes ``tensor``.

    Phase 1 (worker): add ``worker_error``, compress to ``scale * sign``, keep the residual in
    ``worker_error``; rank r receives chunk r of everyone's signs and averages them. Phase 2
    (server): add ``server_error``, compress again, keep that residual; every rank receives
    every chunk. The buffers (zeros at the first call) have the sizes of
    :func:`error_buffer_sizes`; ``kernels`` and ``nonfinite`` are :class:`VoteConfig`'s;
    ``agree_sizes`` as :class:`TransportWork`'s (False only where the sizes agree by construction).
    """
    world_size, _ = group_size_rank(group)
    padded, chunk = error_buffer_sizes(tensor.numel(), world_size)
    if worker_error.numel() < padded or worker_error.numel() % (8 * world_size):
        raise ValueError(
            f"worker_error has {worker_error.numel()} entries; it needs at least {tensor.numel()} (the tensor's) "
            f"and a multiple of 8 * world size = {8 * world_size}"
        )
    padded = worker_error.numel()
    if server_error.numel() != padded // world_size:
        raise ValueError(
            f"server_error has {server_error.numel()} entries; it needs worker_error's / world size = {padded // world_size}"
        )
    flat = torch.zeros(padded, dtype=worker_error.dtype, device=worker_error.device)
    flat[: tensor.numel()] = tensor.reshape(-1)
    encoding = ScaledSignEncoding(kernels_for(flat.device, kernels), worker_error.view(-1), server_error.view(-1))
    result = torch.empty_like(flat)
    work = TransportWork(
        encoding,
        flat,
        group,
        out=result,
        two_phase=True,
        stats=stats,
        nonfinite=nonfinite,
        label=label,
        agree_sizes=agree_sizes,
    )

    def finish() -> torch.Tensor:
        tensor.copy_(work.wait()[: tensor.numel()].view(tensor.shape))
        return tensor

    return work, finish
