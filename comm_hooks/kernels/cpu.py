"""CPU kernels (numba): the per-rank pipeline of the vote in one pass per stage.

Every kernel works on the *bit pattern* of the floats (an unsigned-integer view), so one
compiled loop serves fp16, bf16, fp32 and fp64 alike, including bfloat16, which numpy cannot
represent: ``x > 0`` is "sign bit clear, magnitude nonzero and not NaN", ``x != 0`` is
"magnitude nonzero", "non-finite" is "exponent all ones". Results equal the references in
:mod:`signmuon.comm_hooks.kernels.reference` bit for bit (tested).

Kernels are compiled on first use and cached on disk (``cache=True``), single-threaded:
each rank of a data-parallel job owns a core.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .bits import FLOAT_LAYOUTS, SignSegments, advance_momentum_then_pack, data_words

__all__ = ["pack", "momentum_pack", "unpack", "vote", "tie_words", "NAME"]

NAME = "numba"

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@numba.njit(cache=True, nogil=True)
def _pack_kernel(bits, full_mask, abs_mask, exp_mask, positive, nonzero):  # pragma: no cover - compiled
    # In the unsigned view u of a float: x > 0  <=>  0 < u <= exp_mask (positive, NaN excluded),
    # i.e. (u - 1) mod 2**bits < exp_mask; x != 0  <=>  u & abs_mask != 0; NaN/Inf  <=>  magnitude
    # >= exp_mask. Branch-free, so the 64-entry inner loop vectorises.
    n = bits.size
    full = n // 64
    bad = np.uint64(0)
    zeros = 0
    one = np.uint64(1)
    for w in range(full):
        block = bits[w * 64 : (w + 1) * 64]
        p = np.uint64(0)
        z = np.uint64(0)
        for k in range(64):
            u = np.uint64(block[k])
            a = u & abs_mask
            p |= np.uint64(((u - one) & full_mask) < exp_mask) << np.uint64(k)
            z |= np.uint64(a != 0) << np.uint64(k)
            bad |= np.uint64(a >= exp_mask)
        positive[w] = p
        nonzero[w] = z
        if z != _ALL:
            zeros += 64 - _popcount(z)
    if full < positive.size:  # the tail word; padding bits set in both planes
        p = _ALL
        z = _ALL
        for k in range(n - full * 64):
            u = np.uint64(bits[full * 64 + k])
            a = u & abs_mask
            if not ((u - one) & full_mask) < exp_mask:
                p &= ~(one << np.uint64(k))
            if a == 0:
                z &= ~(one << np.uint64(k))
                zeros += 1
            bad |= np.uint64(a >= exp_mask)
        positive[full] = p
        nonzero[full] = z
    return zeros, bad != 0


@numba.njit(cache=True, inline="always")
def _popcount(x):  # pragma: no cover - compiled
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(cache=True, nogil=True)
def _unpack_kernel(positive, nonzero, ternary, plus, sign_shift, out):  # pragma: no cover - compiled
    # -1 is +1 with the sign bit set; 0 is all bits clear: value = (plus | neg << sign) & -nz.
    n = out.size
    one = np.uint64(1)
    for w in range((n + 63) // 64):
        neg = ~positive[w]
        nz = nonzero[w] if ternary else _ALL
        block = out[w * 64 : min(n, (w + 1) * 64)]
        for k in range(block.size):
            s = np.uint64(k)
            value = plus | (((neg >> s) & one) << sign_shift)
            block[k] = value & (np.uint64(0) - ((nz >> s) & one))


_BLOCK = 256  # words voted together: the counters of a block stay in L1


@numba.njit(cache=True, inline="always")
def _count_into(counter, carry, depth, m):  # pragma: no cover - compiled
    # counter[:, :m] += carry (one bit per position): a ripple-carry add over the bit planes.
    for k in range(depth):
        for w in range(m):
            t = counter[k, w]
            c = carry[w]
            counter[k, w] = t ^ c
            carry[w] = t & c


@numba.njit(cache=True, nogil=True)
def _vote_dense(positive, tie, use_tie, out_pos, out_nz, depth, cpos, carry):  # pragma: no cover - compiled
    # M voters without zeros: +1 wins where its count c > M - c, i.e. 2c > M; a tie is 2c == M.
    # Bit-sliced c against the constant M: compare 2c's bits (c shifted by one) MSB first.
    voters, words = positive.shape
    for start in range(0, words, _BLOCK):
        m = min(_BLOCK, words - start)
        cpos[:, :m] = 0
        for v in range(voters):
            pv = positive[v, start : start + m]
            for w in range(m):
                carry[w] = pv[w]
            _count_into(cpos, carry, depth, m)
        for w in range(m):
            greater = np.uint64(0)
            equal = _ALL
            for k in range(depth, -1, -1):  # bit k of 2c is bit k-1 of c; bit k of M is a constant
                a = cpos[k - 1, w] if k >= 1 else np.uint64(0)
                b = _ALL if (voters >> k) & 1 else np.uint64(0)
                greater |= equal & a & ~b
                equal &= ~(a ^ b)
            if use_tie:
                out_pos[start + w] = greater | (equal & tie[start + w])
                out_nz[start + w] = _ALL
            else:
                out_pos[start + w] = greater
                out_nz[start + w] = ~equal


@numba.njit(cache=True, nogil=True)
def _vote_kernel(positive, nonzero, dense, tie, use_tie, out_pos, out_nz, depth):  # pragma: no cover
    # Bit-sliced counters of +1 and -1 voters, one bit plane per counter bit, vectorised across
    # a block of words: voter by voter, a ripple-carry add per plane; then compare MSB first.
    voters, words = positive.shape
    cpos = np.empty((depth, _BLOCK), np.uint64)
    cneg = np.empty((depth, _BLOCK), np.uint64)
    carry = np.empty(_BLOCK, np.uint64)
    any_nz = np.empty(_BLOCK, np.uint64)
    all_dense = True
    for v in range(voters):
        all_dense = all_dense and dense[v]
    if all_dense:  # no zeros anywhere: count the +1 voters only (the rest are -1)
        _vote_dense(positive, tie, use_tie, out_pos, out_nz, depth, cpos, carry)
        return
    for start in range(0, words, _BLOCK):
        m = min(_BLOCK, words - start)
        cpos[:, :m] = 0
        cneg[:, :m] = 0
        any_nz[:m] = 0
        for v in range(voters):
            pv = positive[v, start : start + m]
            for w in range(m):
                carry[w] = pv[w]
            _count_into(cpos, carry, depth, m)
            if dense[v]:  # no zeros: every entry is +1 or -1
                for w in range(m):
                    carry[w] = ~pv[w]
                    any_nz[w] = _ALL
            else:
                zv = nonzero[v, start : start + m]
                for w in range(m):
                    carry[w] = zv[w] & ~pv[w]
                    any_nz[w] |= zv[w]
            _count_into(cneg, carry, depth, m)
        for w in range(m):
            greater = np.uint64(0)
            less = np.uint64(0)
            equal = _ALL
            for k in range(depth - 1, -1, -1):
                a = cpos[k, w]
                b = cneg[k, w]
                greater |= equal & a & ~b
                less |= equal & ~a & b
                equal &= ~(a ^ b)
            if use_tie:
                ties = any_nz[w] & equal
                out_pos[start + w] = greater | (ties & tie[start + w])
                out_nz[start + w] = greater | less | ties
            else:
                out_pos[start + w] = greater
                out_nz[start + w] = greater | less


@numba.njit(cache=True, inline="always")
def _mix64(z):  # pragma: no cover - compiled; splitmix64's finaliser
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def _tie_kernel(call_key, starts, keys, firsts, first_entry, out):  # pragma: no cover - compiled
    # Entry e of segment s (index i = e - starts[s] + firsts[s] in its tensor) draws bit (i & 63) of
    # mix64(mix64(call_key ^ keys[s]) + (i >> 6) * GOLDEN): keyed to the segment, not the layout.
    golden = np.uint64(0x9E3779B97F4A7C15)
    nseg = keys.size
    s = 0
    for w in range(out.size):
        lo = first_entry + w * 64
        hi = lo + 64
        while s + 1 < nseg and starts[s + 1] <= lo:
            s += 1
        word = np.uint64(0)
        e = lo
        t = s
        while e < hi and t < nseg:
            end = min(hi, starts[t + 1])
            if end <= e:
                t += 1
                continue
            seg_key = _mix64(call_key ^ np.uint64(keys[t]))
            i = e - starts[t] + firsts[t]
            while e < end:
                h = _mix64(seg_key + np.uint64(i >> 6) * golden)
                take = min(end - e, 64 - (i & 63))
                chunk = h >> np.uint64(i & 63)
                if take < 64:
                    chunk &= (np.uint64(1) << np.uint64(take)) - np.uint64(1)
                word |= chunk << np.uint64(e - lo)
                e += take
                i += take
            t += 1
        out[w] = word


def _u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint64)


def _bits(x: torch.Tensor) -> np.ndarray:
    layout = FLOAT_LAYOUTS[x.dtype]
    return x.view(layout.int_dtype).numpy().view(layout.np_uint)


def pack(x: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(positive, nonzero, zeros, nonfinite)`` of flat contiguous ``x``: int64 [words] planes
    (pad bits set in both), the number of exact zeros and whether any entry is NaN or Inf."""
    layout = FLOAT_LAYOUTS[x.dtype]
    positive = torch.empty(words, dtype=torch.int64)
    nonzero = torch.empty(words, dtype=torch.int64)
    if x.numel() == 0:
        positive.fill_(-1), nonzero.fill_(-1)
        return positive, nonzero, 0, False
    zeros, bad = _pack_kernel(
        _bits(x),
        np.uint64((1 << layout.bits) - 1),
        np.uint64(layout.abs_mask),
        np.uint64(layout.exp_mask),
        _u64(positive),
        _u64(nonzero),
    )
    used = data_words(x.numel())
    positive[used:] = -1  # whole words past the data are padding too
    nonzero[used:] = -1
    return positive, nonzero, int(zeros), bool(bad)


# Two passes: torch's lerp_ already runs at memory speed, and a numba loop mixing the update
# with the bit packing does not vectorise (measured slower: benchmarks/results, vote-cpu-speed).
momentum_pack = functools.partial(advance_momentum_then_pack, pack)


def unpack(positive: torch.Tensor, nonzero: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write the ±1 (or 0 where ``nonzero``'s bit is clear) entries into flat contiguous ``out``."""
    layout = FLOAT_LAYOUTS[out.dtype]
    ternary = nonzero is not None
    _unpack_kernel(
        _u64(positive),
        _u64(nonzero if ternary else positive),
        ternary,
        np.uint64(layout.plus_one),
        np.uint64(layout.bits - 1),
        _bits(out),
    )


def vote(positive: torch.Tensor, nonzero: torch.Tensor | None, dense, tie: torch.Tensor | None):
    """Vote [M, S] planes; ``dense[v]`` marks voters without zeros (their ``nonzero`` row unused).

    Returns ``(positive, nonzero)`` int64 [S] planes of the voted sign.
    """
    voters, words = positive.shape
    if nonzero is None:
        nonzero = positive
        dense = [True] * voters
    out_pos = torch.empty(words, dtype=torch.int64)
    out_nz = torch.empty(words, dtype=torch.int64)
    tie_np = _u64(tie) if tie is not None else np.empty(0, dtype=np.uint64)
    _vote_kernel(
        _u64(positive.contiguous()),
        _u64(nonzero.contiguous()),
        np.asarray(dense, dtype=np.bool_),
        tie_np,
        tie is not None,
        _u64(out_pos),
        _u64(out_nz),
        max(1, voters.bit_length()),
    )
    return out_pos, out_nz


def tie_words(segments: SignSegments, call_key: int, first_entry: int, words: int, device=None) -> torch.Tensor:
    """int64 [words] tie-break bits for entries ``first_entry ..`` (see ``SignSegments``)."""
    out = torch.empty(words, dtype=torch.int64)
    starts = np.asarray(segments.starts, dtype=np.int64)
    keys = np.asarray(segments.keys, dtype=np.uint64)
    firsts = np.asarray(segments.first_indices, dtype=np.int64)
    _tie_kernel(np.uint64(call_key & 0xFFFFFFFFFFFFFFFF), starts, keys, firsts, first_entry, _u64(out))
    return out
