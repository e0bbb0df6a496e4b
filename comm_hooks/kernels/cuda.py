"""CUDA kernels (Triton) for pack and unpack; the shard vote and tie bits as torch operations.

Pack reads the gradient once and writes both planes, the zero count and the NaN/Inf flag;
unpack writes ±1/0 straight into the output. Like the CPU kernels they work on the floats' bit
patterns, one kernel for fp16, bf16, fp32 and fp64. The vote touches only the packed 1/M
shard (1/256 of an fp32 gradient's bytes for M = 8), so plain torch bit operations on 64-bit
words serve it; a kernel there would save nothing measurable.

Tested in CI without a GPU under ``TRITON_INTERPRET=1`` against the references, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_ops
from .layout import FLOAT_LAYOUTS, SignSegments, data_words

__all__ = ["pack", "unpack", "vote", "tie_words", "NAME"]

NAME = "triton"
_WORDS_PER_PROGRAM = 16


@triton.jit
def _pack_kernel(bits_ptr, pos_ptr, nz_ptr, zeros_ptr, bad_ptr, n, nwords, full_mask, abs_mask, exp_mask, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    word = pid * WORDS + tl.arange(0, WORDS)  # [WORDS]
    lane = tl.arange(0, 64)  # [64]
    index = word[:, None] * 64 + lane[None, :]  # [WORDS, 64]
    inside = index < n
    u = tl.load(bits_ptr + index, mask=inside, other=0).to(tl.uint64) & full_mask
    a = u & abs_mask
    positive = (((u - 1) & full_mask) < exp_mask) | ~inside  # padding bits set
    nonzero = (a != 0) | ~inside
    weight = tl.full([64], 1, tl.uint64) << lane.to(tl.uint64)
    pos_word = tl.sum(tl.where(positive, weight[None, :], 0), axis=1)  # distinct bits: sum is OR
    nz_word = tl.sum(tl.where(nonzero, weight[None, :], 0), axis=1)
    tl.store(pos_ptr + word, pos_word.to(tl.int64, bitcast=True), mask=word < nwords)
    tl.store(nz_ptr + word, nz_word.to(tl.int64, bitcast=True), mask=word < nwords)
    tl.atomic_add(zeros_ptr, tl.sum(tl.sum((~nonzero).to(tl.int64), axis=1), axis=0))
    tl.atomic_max(bad_ptr, tl.max(tl.max(((a >= exp_mask) & inside).to(tl.int32), axis=1), axis=0))


@triton.jit
def _unpack_kernel(pos_ptr, nz_ptr, out_ptr, n, nwords, plus, sign_shift, TERNARY: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    word = pid * WORDS + tl.arange(0, WORDS)
    lane = tl.arange(0, 64)
    index = word[:, None] * 64 + lane[None, :]
    inside = index < n
    pos = tl.load(pos_ptr + word, mask=word < nwords, other=-1).to(tl.uint64, bitcast=True)
    bit = (pos[:, None] >> lane[None, :].to(tl.uint64)) & 1
    value = plus | ((1 - bit) << sign_shift)  # -1 is +1 with the sign bit set
    if TERNARY:
        nz = tl.load(nz_ptr + word, mask=word < nwords, other=-1).to(tl.uint64, bitcast=True)
        value = tl.where(((nz[:, None] >> lane[None, :].to(tl.uint64)) & 1) != 0, value, 0)
    tl.store(out_ptr + index, value.to(out_ptr.dtype.element_ty), mask=inside)


def _unsigned_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(FLOAT_LAYOUTS[x.dtype].int_dtype)


def pack(x: torch.Tensor, words: int):
    layout = FLOAT_LAYOUTS[x.dtype]
    positive = torch.full((words,), -1, dtype=torch.int64, device=x.device)
    nonzero = torch.full((words,), -1, dtype=torch.int64, device=x.device)
    zeros = torch.zeros(1, dtype=torch.int64, device=x.device)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    used = data_words(x.numel())
    if used:  # words past the data keep their fill: all padding
        _pack_kernel[(triton.cdiv(used, _WORDS_PER_PROGRAM),)](
            _unsigned_view(x), positive, nonzero, zeros, bad, x.numel(), used, (1 << layout.bits) - 1,
            layout.abs_mask, layout.exp_mask, WORDS=_WORDS_PER_PROGRAM,
        )  # fmt: skip
    # Padding bits are not zeros: the kernel counts only entries inside the data.
    return positive, nonzero, zeros[0], bad[0].bool()


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, out: torch.Tensor) -> None:
    n = out.numel()
    if n == 0:
        return
    layout = FLOAT_LAYOUTS[out.dtype]
    used = data_words(n)
    _unpack_kernel[(triton.cdiv(used, _WORDS_PER_PROGRAM),)](
        positive, positive if nonzero is None else nonzero, _unsigned_view(out), n, used, layout.plus_one,
        layout.bits - 1, TERNARY=nonzero is not None, WORDS=_WORDS_PER_PROGRAM,
    )  # fmt: skip


def vote(positive: torch.Tensor, nonzero: torch.Tensor | None, dense: torch.Tensor | None, tie: torch.Tensor | None):
    return torch_ops.vote(positive, nonzero, dense, tie)


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    return torch_ops.tie_words(segments, call_key, first_entry, words, device)
