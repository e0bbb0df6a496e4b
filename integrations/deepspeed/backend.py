"""A compressed communication backend with DeepSpeed's former interface.

DeepSpeed's 1-bit Adam / 0/1 Adam / 1-bit LAMB called ``backend.compressed_allreduce(
buffer_m, worker_error, server_error, local_rank)``: an error-feedback, scaled-sign
all-reduce in two phases (its ``NcclBackend`` and ``MpiBackend``, removed in 0.19.8). This
backend keeps that contract on any torch process group (gloo or NCCL, including DeepSpeed's
groups, which are torch groups), on the same transport as the majority vote
(``signmuon.comm_hooks.vote.transport.TransportWork`` with ``ScaledSignEncoding``), and adds the vote itself
as :meth:`majority_vote`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from signmuon.comm_hooks import CommStats, VoteConfig, majority_vote
from signmuon.comm_hooks.dist import group_size_rank
from signmuon.comm_hooks.vote import scaled_sign_allreduce
from signmuon.comm_hooks.vote.encodings import scaled_sign

__all__ = ["SignCompressedBackend", "scaled_sign"]


class SignCompressedBackend:
    """Error-feedback 1-bit all-reduce and majority vote over ``process_group``.

    Args:
        process_group: the data-parallel group (None = WORLD).
        vote: settings of :meth:`majority_vote`. :meth:`compressed_allreduce` honours its
            ``kernels`` and ``nonfinite`` (scaled signs have no ties, so ``tie`` and ``seed`` do
            not apply) and refuses ``algorithm="all_gather"``, ``fault`` and ``zeros="coin"``
            (error feedback carries what a zero leaves out), which it cannot honour; ``hierarchical`` is refused here (a node-aware vote needs the hooks'
            node layout).

    Statistics: ``stats`` (a :class:`CommStats`) counts bytes sent and received.
    """

    __slots__ = ("process_group", "size", "rank", "stats", "vote_config")

    def __init__(self, process_group: dist.ProcessGroup | None = None, vote: VoteConfig | None = None) -> None:
        self.process_group = process_group
        self.size, self.rank = group_size_rank(process_group)
        self.stats = CommStats()
        vote = VoteConfig.of(vote)
        if vote.hierarchical:
            raise ValueError(
                "SignCompressedBackend votes over its process group as it is; for the node-aware vote "
                "(VoteConfig(hierarchical=True)) use the DDP hooks or a sign-vote optimizer from the DeepSpeed config"
            )
        self.vote_config = vote

    def majority_vote(self, tensor: torch.Tensor, *, step: int = 0) -> torch.Tensor:
        """``sign(sum_i sign(tensor_i))`` in place (the collective of the DDP hooks)."""
        return majority_vote(tensor, self.process_group, self.vote_config, step=step, out=tensor, stats=self.stats)

    def compressed_allreduce(
        self,
        buffer_m: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        local_rank: int | None = None,
    ) -> torch.Tensor:
        """Average ``buffer_m`` over the ranks at one bit per entry, with error feedback.

        Phase 1 (worker): add ``worker_error``, compress to ``scale * sign``, keep the residual
        in ``worker_error``; the transport's all-to-all gives rank r chunk r of everyone's signs
        (scales in the headers), which it averages (the "server" part).
        Phase 2 (server): add ``server_error``, compress again, keep that residual in
        ``server_error``; the transport's all-gather gives everyone every chunk and its scale.

        Args:
            buffer_m: the tensor to average (any shape); overwritten with the result and returned.
            worker_error: [N] with N >= buffer_m.numel() and N divisible by 8 * world size,
                the feedback buffer of this rank (zeros at the first call).
            server_error: [N / world size], the feedback of this rank's chunk.
            local_rank: accepted for DeepSpeed's signature; devices follow the tensors.
        """
        config = self.vote_config
        if config.algorithm == "all_gather" or config.fault is not None or config.zeros != "abstain":
            raise ValueError(
                "compressed_allreduce always runs two phases, has no fault injection and no zero rule: pass a VoteConfig "
                "with algorithm='auto' or 'two_phase', no fault and zeros='abstain' (those settings apply to majority_vote)"
            )
        if config.encoding != "sign":
            raise ValueError(
                f"compressed_allreduce sends 1-bit Adam's scaled signs, not VoteConfig(encoding={config.encoding!r}): "
                "the encoding applies to majority votes (the hooks, the optimizers)"
            )
        return scaled_sign_allreduce(
            buffer_m,
            worker_error,
            server_error,
            self.process_group,
            kernels=config.kernels,
            nonfinite=config.nonfinite,
            stats=self.stats,
            label="compressed_allreduce",
        )
