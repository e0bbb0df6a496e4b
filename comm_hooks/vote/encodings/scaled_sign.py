"""Error-feedback scaled signs (1-bit Adam's compression) as an encoding of the transport; the
all-reduce built on it is :func:`~signmuon.comm_hooks.vote.scaled_sign_allreduce`."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from ...dist import from_host
from ...kernels.bits import words_for
from .sign import EncodedRows
from .wire import Plan

__all__ = ["ScaledSignEncoding", "error_buffer_sizes", "scaled_sign"]


def scaled_sign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, signs): ``scale = ||x|| / sqrt(n)`` and signs in {-1, +1}, with sign(0) = +1.

    ``scale * signs`` has x's RMS (1-bit Adam's compression). Should the norm overflow for
    finite input (entries near the dtype's maximum), it is taken of ``x / max|x|`` instead: on
    the CPU only then; elsewhere always, and selected on the device (no host synchronisation).
    """
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    if x.device.type == "cpu":
        if not bool(torch.isfinite(scale)) and bool(torch.isfinite(x).all()):
            scale = _rescaled_norm(x)
    else:
        scale = torch.where(torch.isfinite(scale) | ~torch.isfinite(x).all(), scale, _rescaled_norm(x))
    signs = x.ge(0).to(x.dtype).mul_(2).sub_(1)
    return scale, signs


def _rescaled_norm(x: torch.Tensor) -> torch.Tensor:
    peak = x.abs().max()
    return torch.linalg.vector_norm(x / peak) * (peak / math.sqrt(x.numel()))


def _word_rows(rows: torch.Tensor, words: int) -> torch.Tensor:
    """[R, 64·words] view of ``rows`` [R, n] (a zero-padded copy where n is not whole words): one
    kernel call packs or unpacks every row."""
    if rows.shape[1] == 64 * words:
        return rows
    padded = rows.new_zeros(rows.shape[0], 64 * words)
    padded[:, : rows.shape[1]] = rows
    return padded


class ScaledSignEncoding:
    """Error-feedback scaled sign (1-bit Adam's compression) as an encoding: each rank sends
    ``scale * sign(x + worker_error)`` with ``scale = ||x + worker_error|| / sqrt(n)`` and keeps
    the residual as its new worker error; the server part averages the M senders'
    ``scale_i * sign_i``, compresses again with its own error feedback, and every rank decodes
    ``scale_r * sign_r`` per part. ``sign(0) = +1``. The scale travels in the header's value word.

    Args:
        kernels: the kernel family.
        worker_error: this rank's feedback buffer, as long as the encoded tensor (updated in ``encode``).
        server_error: this rank's feedback buffer for its part (updated in ``reduce``).
    """

    __slots__ = ("kernels", "worker_error", "server_error")

    def __init__(self, kernels: ModuleType, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        self.kernels, self.worker_error, self.server_error = kernels, worker_error, server_error

    def plan(self, numel: int, world_size: int, rank: int, two_phase: bool) -> Plan:
        chunk = numel // world_size
        return Plan(world_size, rank, numel, world_size, chunk, words_for(chunk), True)

    def _signs_rows(self, rows: torch.Tensor, words: int) -> torch.Tensor:
        """int64 [R, words]: bit set where the entry is >= 0 (NaN counts as negative), all rows
        in one pack (a zero's padding bit packs as set, as the kernels' padding does)."""
        padded = _word_rows(rows, words)
        positive, nonzero, _, _ = self.kernels.pack(padded.reshape(-1), rows.shape[0] * words)
        return (positive | ~nonzero).view(rows.shape[0], words)

    def _unpack(self, rows: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[R, numel] ±1 of packed ``rows`` [R, words], in one unpack."""
        out = torch.empty(rows.shape[0], 64 * rows.shape[1], dtype=dtype, device=rows.device)
        self.kernels.unpack(rows.reshape(-1), None, out.view(-1))
        return out[:, :numel]

    @staticmethod
    def _scales(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[M] the float64 scales of the header words, in ``dtype`` on ``device`` (no pageable copy)."""
        return from_host(values, torch.int64, device).view(torch.float64).to(dtype)

    def encode(self, flat: torch.Tensor, plan: Plan) -> EncodedRows:
        flat = flat + self.worker_error
        scale, signs = scaled_sign(flat)
        self.worker_error.copy_(flat - scale * signs)
        rows = self._signs_rows(flat.view(plan.parts, plan.part_entries), plan.words)
        scale = scale.to(torch.float64).reshape(1).view(torch.int64).expand(plan.parts)
        codes = torch.zeros(plan.parts, dtype=torch.int64, device=flat.device)
        return EncodedRows(rows, codes, scale.contiguous(), ~torch.isfinite(flat).all(), None)

    def reduce(self, rows, codes, values, extras, part, plan) -> EncodedRows:
        dtype = self.server_error.dtype
        scales = self._scales(values, dtype, rows.device)
        signs = self._unpack(rows, plan.part_entries, dtype)  # [M, chunk]
        server = (signs * (scales / plan.world_size).unsqueeze(1)).sum(dim=0)
        server.add_(self.server_error)
        scale, server_signs = scaled_sign(server)
        self.server_error.copy_(server - scale * server_signs)
        zero = torch.zeros(1, dtype=torch.int64, device=rows.device)
        value = scale.to(torch.float64).reshape(1).view(torch.int64)
        return EncodedRows(self._signs_rows(server.unsqueeze(0), plan.words), zero, value, False, None)

    def decode(self, rows, codes, values, extras, plan, out) -> None:
        parts = out.view(-1)[: rows.shape[0] * plan.part_entries].view(rows.shape[0], plan.part_entries)
        parts.copy_(self._unpack(rows, plan.part_entries, out.dtype))
        parts.mul_(self._scales(values, out.dtype, out.device).unsqueeze(1))


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """(worker error, server error) entries for :func:`scaled_sign_allreduce` of ``numel`` entries:
    ``numel`` rounded up to a multiple of 8 * world size, and that over the world size."""
    padded = -(-numel // (8 * world_size)) * 8 * world_size
    return padded, padded // world_size
