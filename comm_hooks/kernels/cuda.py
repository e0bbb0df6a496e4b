"""CUDA kernels (Triton) for pack, Signum's momentum step fused with pack, and unpack; the shard
vote and tie bits as torch operations.

Pack reads the gradient once and writes both planes, the zero count and the NaN/Inf flag;
``momentum_pack`` reads the momentum and the gradient once, writes the new momentum and packs
it in the same pass (torch's lerp, then pack, was five passes and a temporary);
unpack writes ±1/0 straight into the output. Like the CPU kernels they work on the floats' bit
patterns, one kernel for fp16, bf16, fp32 and fp64. The vote touches only the packed 1/M
shard (1/256 of an fp32 gradient's bytes for M = 8), so plain torch bit operations on 64-bit
words serve it; a kernel there would save nothing measurable.

Tested in CI without a GPU under ``TRITON_INTERPRET=1`` against the references, bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import torch_ops
from .bits import FLOAT_LAYOUTS, SignSegments, data_words

__all__ = ["pack", "momentum_pack", "unpack", "vote", "tie_words", "NAME"]

NAME = "triton"
_WORDS_PER_PROGRAM = 16
CHUNK_WORDS = 1 << 24
"""Words one launch covers (2^30 entries): the kernels index in 32-bit integers, and past 2^31
entries an offset would wrap negative, pass ``index < n`` and read or write out of bounds. A
longer tensor runs as several launches on slices of it, offset on the host in 64 bits (tests
lower this to check the chunking bit for bit)."""


def _chunks(words: int):
    """(first word, words) of each launch."""
    for first in range(0, words, CHUNK_WORDS):
        yield first, min(CHUNK_WORDS, words - first)


@triton.jit
def _store_planes(u, inside, lane, word, nwords, pos_ptr, nz_ptr, zeros_ptr, bad_ptr, full_mask, abs_mask, exp_mask):
    """The end of both packing kernels: from the float bits ``u`` [WORDS, 64] of a block, store its
    positive and nonzero planes (padding bits set), count its zeros, flag a NaN or Inf."""
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
def _pack_kernel(
    bits_ptr, pos_ptr, nz_ptr, zeros_ptr, bad_ptr, n, nwords, full_mask, abs_mask, exp_mask, WORDS: tl.constexpr
):
    pid = tl.program_id(0)
    word = pid * WORDS + tl.arange(0, WORDS)  # [WORDS]
    lane = tl.arange(0, 64)  # [64]
    index = word[:, None] * 64 + lane[None, :]  # [WORDS, 64]
    inside = index < n
    u = tl.load(bits_ptr + index, mask=inside, other=0).to(tl.uint64) & full_mask
    _store_planes(u, inside, lane, word, nwords, pos_ptr, nz_ptr, zeros_ptr, bad_ptr, full_mask, abs_mask, exp_mask)


@triton.jit
def _bf16_nearest_even(x):
    """fp32 -> bf16, rounding to nearest even as torch does, in integer arithmetic (the same on a
    GPU and in the interpreter, whose float cast truncates)."""
    b = x.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (b >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _momentum_pack_kernel(
    m_ptr,
    g_ptr,
    skip_ptr,
    weight_ptr,
    pos_ptr,
    nz_ptr,
    zeros_ptr,
    bad_ptr,
    n,
    nwords,
    full_mask,
    abs_mask,
    exp_mask,
    INT_TYPE: tl.constexpr,
    BF16: tl.constexpr,
    SMALL_WEIGHT: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    word = pid * WORDS + tl.arange(0, WORDS)
    lane = tl.arange(0, 64)
    index = word[:, None] * 64 + lane[None, :]
    inside = index < n
    m = tl.load(m_ptr + index, mask=inside, other=0)
    if tl.load(skip_ptr) == 0:  # the same for every program: a non-finite gradient moves nothing
        weight = tl.load(weight_ptr)  # in torch's lerp arithmetic: fp32, or fp64 for fp64
        old = m.to(weight.dtype)
        g = tl.load(g_ptr + index, mask=inside, other=0).to(m.dtype).to(weight.dtype)  # exact widenings
        if SMALL_WEIGHT:  # torch's lerp: the fma from whichever end the weight is nearer
            new = tl.fma(weight, g - old, old)
        else:
            new = tl.fma(weight - 1, g - old, g)
        if BF16:
            m = _bf16_nearest_even(new)
        else:
            m = new.to(m.dtype)
        tl.store(m_ptr + index, m, mask=inside)
    u = m.to(INT_TYPE, bitcast=True).to(tl.uint64) & full_mask
    _store_planes(u, inside, lane, word, nwords, pos_ptr, nz_ptr, zeros_ptr, bad_ptr, full_mask, abs_mask, exp_mask)


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


def _pack_outputs(words: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Both planes (all bits set: words past the data stay padding), the zero count, the NaN/Inf flag."""
    positive = torch.full((words,), -1, dtype=torch.int64, device=device)
    nonzero = torch.full((words,), -1, dtype=torch.int64, device=device)
    return (
        positive,
        nonzero,
        torch.zeros(1, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
    )


def _unsigned_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(FLOAT_LAYOUTS[x.dtype].int_dtype)


def _pack_arguments(outputs: tuple, first: int, n: int, count: int, layout) -> tuple:
    """The arguments both packing kernels end with: the outputs from word ``first`` on, this
    launch's entries and words, and the float layout's masks."""
    positive, nonzero, zeros, bad = outputs
    masks = ((1 << layout.bits) - 1, layout.abs_mask, layout.exp_mask)
    return (positive[first:], nonzero[first:], zeros, bad, n, count, *masks)


def pack(x: torch.Tensor, words: int):
    layout = FLOAT_LAYOUTS[x.dtype]
    outputs = positive, nonzero, zeros, bad = _pack_outputs(words, x.device)
    bits = _unsigned_view(x).view(-1)
    for first, count in _chunks(data_words(x.numel())):  # words past the data keep their fill: all padding
        n = min(64 * count, x.numel() - 64 * first)
        _pack_kernel[(triton.cdiv(count, _WORDS_PER_PROGRAM),)](
            bits[64 * first :], *_pack_arguments(outputs, first, n, count, layout), WORDS=_WORDS_PER_PROGRAM
        )
    # Padding bits are not zeros: the kernel counts only entries inside the data.
    return positive, nonzero, zeros[0], bad[0].bool()


_INT_TYPES = {16: tl.int16, 32: tl.int32, 64: tl.int64}


@functools.lru_cache(maxsize=64)
def _weight_on(weight: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight as a one-entry tensor on the device (kept: no copy per call), in lerp's arithmetic."""
    return torch.tensor([weight], dtype=dtype, device=device)


def momentum_pack(buf: torch.Tensor, grad: torch.Tensor, weight: float, skip: torch.Tensor, words: int):
    """``buf.lerp_(grad, weight)`` unless ``skip``, then ``pack(buf, words)``, in one pass."""
    if grad.shape != buf.shape or not (buf.is_contiguous() and grad.is_contiguous()):
        raise ValueError("momentum_pack needs contiguous tensors of one shape")
    if grad.dtype != buf.dtype and grad.element_size() >= buf.element_size():
        grad = grad.to(buf.dtype)  # a rounding cast, as lerp_'s caller makes; widening ones run in the kernel
    layout = FLOAT_LAYOUTS[buf.dtype]
    outputs = positive, nonzero, zeros, bad = _pack_outputs(words, buf.device)
    math_dtype = torch.float64 if buf.dtype == torch.float64 else torch.float32  # torch's lerp arithmetic
    weight_t = _weight_on(weight, math_dtype, buf.device)
    skip_flag = skip.reshape(1).to(torch.int8)
    for first, count in _chunks(data_words(buf.numel())):
        n, at = min(64 * count, buf.numel() - 64 * first), 64 * first
        _momentum_pack_kernel[(triton.cdiv(count, _WORDS_PER_PROGRAM),)](
            buf.view(-1)[at:],
            grad.view(-1)[at:],
            skip_flag,
            weight_t,
            *_pack_arguments(outputs, first, n, count, layout),
            INT_TYPE=_INT_TYPES[layout.bits],
            BF16=buf.dtype == torch.bfloat16,
            SMALL_WEIGHT=abs(float(torch.tensor(weight, dtype=math_dtype))) < 0.5,
            WORDS=_WORDS_PER_PROGRAM,
        )
    return positive, nonzero, zeros[0], bad[0].bool()


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, out: torch.Tensor) -> None:
    n = out.numel()
    if n == 0:
        return
    layout = FLOAT_LAYOUTS[out.dtype]
    bits = _unsigned_view(out).view(-1)
    planes = positive if nonzero is None else nonzero
    for first, count in _chunks(data_words(n)):
        _unpack_kernel[(triton.cdiv(count, _WORDS_PER_PROGRAM),)](
            positive[first:],
            planes[first:],
            bits[64 * first :],
            min(64 * count, n - 64 * first),
            count,
            layout.plus_one,
            layout.bits - 1,
            TERNARY=nonzero is not None,
            WORDS=_WORDS_PER_PROGRAM,
        )


def vote(positive: torch.Tensor, nonzero: torch.Tensor | None, dense, tie: torch.Tensor | None):
    return torch_ops.vote(positive, nonzero, dense, tie)


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    return torch_ops.tie_words(segments, call_key, first_entry, words, device)
