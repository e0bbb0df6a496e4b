"""A compressed communication backend with DeepSpeed's former interface.

DeepSpeed's 1-bit Adam / 0/1 Adam / 1-bit LAMB called ``backend.compressed_allreduce(
buffer_m, worker_error, server_error, local_rank)``: an error-feedback, scaled-sign
all-reduce in two phases (its ``NcclBackend`` and ``MpiBackend``, removed in 0.19.8). This
backend keeps that contract on any torch process group (gloo or NCCL, including DeepSpeed's
groups, which are torch groups), with the packing and collectives of
``signmuon.comm_hooks``, and adds the 1-bit majority vote as :meth:`majority_vote`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, majority_vote, packed_size, unpack_signs
from signmuon.comm_hooks.collective import _group_size_rank
from signmuon.comm_hooks.packing import _bits_to_bytes

__all__ = ["SignCompressedBackend", "scaled_sign"]


def scaled_sign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, signs): ``scale = ||x|| / sqrt(n)`` and signs in {-1, +1}, with sign(0) = +1.

    DeepSpeed's 1-bit scheme: ``scale * signs`` has x's RMS, and the difference is the error
    fed back into the next call.
    """
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    signs = x.ge(0).to(x.dtype).mul_(2).sub_(1)  # +1 / -1, with sign(0) = +1
    return scale, signs


class SignCompressedBackend:
    """Error-feedback 1-bit all-reduce and majority vote over ``process_group``.

    Args:
        process_group: the data-parallel group (None = WORLD).

    Statistics: ``stats`` (a :class:`CommStats`) counts bytes sent and received.
    """

    __slots__ = ("process_group", "size", "rank", "stats")

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.size, self.rank = _group_size_rank(process_group)
        self.stats = CommStats()

    def majority_vote(self, tensor: torch.Tensor, *, tie: str = "exact", seed: int = 0) -> torch.Tensor:
        """``sign(sum_i sign(tensor_i))`` in place (the collective of the DDP hooks)."""
        return majority_vote(tensor, self.process_group, tie=tie, seed=seed, out=tensor, stats=self.stats)

    def _pack(self, signs: torch.Tensor) -> torch.Tensor:
        return _bits_to_bytes(signs > 0)

    def compressed_allreduce(
        self,
        buffer_m: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        local_rank: int | None = None,
    ) -> torch.Tensor:
        """Average ``buffer_m`` over the ranks at one bit per entry, with error feedback.

        Phase 1 (worker): add ``worker_error``, compress to ``scale * sign``, keep the residual
        in ``worker_error``; all-to-all the packed signs so rank r holds chunk r of everyone's,
        all-gather the scales; average chunk r (the "server" part).
        Phase 2 (server): add ``server_error``, compress again, keep that residual in
        ``server_error``; all-gather the packed chunks and their scales.

        Args:
            buffer_m: the tensor to average (any shape); overwritten with the result and returned.
            worker_error: [N] with N >= buffer_m.numel() and N divisible by 8 * world size,
                the feedback buffer of this rank (zeros at the first call).
            server_error: [N / world size], the feedback of this rank's chunk.
            local_rank: accepted for DeepSpeed's signature; devices follow the tensors.
        """
        original_shape, original_size = buffer_m.shape, buffer_m.numel()
        padded_size = worker_error.numel()
        chunk = padded_size // self.size
        if padded_size < original_size or padded_size % (8 * self.size):
            raise ValueError(
                f"worker_error has {padded_size} entries; it needs at least buffer_m's {original_size} "
                f"and a multiple of 8 * world size = {8 * self.size}"
            )
        if server_error.numel() != chunk:
            raise ValueError(f"server_error has {server_error.numel()} entries; it needs worker_error's / world size = {chunk}")
        self.stats.calls += 1
        flat = torch.zeros(padded_size, dtype=worker_error.dtype, device=worker_error.device)
        flat[:original_size] = buffer_m.reshape(-1)

        # Phase 1: worker compression with error feedback.
        flat.add_(worker_error)
        scale, signs = scaled_sign(flat)
        worker_error.copy_(flat - scale * signs)
        packed = self._pack(signs).view(self.size, chunk // 8)  # [M, chunk/8]: row r goes to rank r
        recv = torch.empty_like(packed)
        scales = torch.empty(self.size, dtype=scale.dtype, device=scale.device)
        if self.size > 1:
            dist.all_to_all_single(recv, packed, group=self.process_group)
            dist.all_gather(list(scales.unbind(0)), scale.reshape(()), group=self.process_group)
        else:
            recv.copy_(packed)
            scales[0] = scale
        self._account((self.size - 1) * (chunk // 8 + scale.element_size()))
        signs_in = torch.stack([unpack_signs(row, chunk, dtype=flat.dtype) for row in recv])  # [M, chunk]
        server = (signs_in * (scales / self.size).unsqueeze(1)).sum(dim=0)  # mean of scale_i * sign_i

        # Phase 2: server compression with error feedback, then everyone gathers every chunk.
        server.add_(server_error)
        server_scale, server_signs = scaled_sign(server)
        server_error.copy_(server - server_scale * server_signs)
        mine = self._pack(server_signs)  # [chunk/8]
        gathered = mine.new_empty(self.size, packed_size(chunk))
        gathered_scales = torch.empty(self.size, dtype=server_scale.dtype, device=server_scale.device)
        if self.size > 1:
            dist.all_gather(list(gathered.unbind(0)), mine, group=self.process_group)
            dist.all_gather(list(gathered_scales.unbind(0)), server_scale.reshape(()), group=self.process_group)
        else:
            gathered.copy_(mine.unsqueeze(0))
            gathered_scales[0] = server_scale
        self._account((self.size - 1) * (chunk // 8 + server_scale.element_size()))
        result = torch.cat(
            [unpack_signs(row, chunk, dtype=flat.dtype) * s for row, s in zip(gathered, gathered_scales)]
        )
        buffer_m.copy_(result[:original_size].view(original_shape))
        return buffer_m

    def _account(self, bytes_each_way: int) -> None:
        self.stats.add(bytes_each_way, bytes_each_way)
