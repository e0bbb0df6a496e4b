"""Sign bit packing: one bit per gradient entry.

Layout (the wire format of every collective in this package): entry ``8*j + k`` of the
flattened tensor is bit ``k`` (least significant first) of byte ``j``; a tensor of ``n``
entries packs into ``ceil(n / 8)`` bytes and the unused high bits of the last byte are 0.

Two planes describe a ternary sign: ``positive`` (``x > 0``) and ``nonzero`` (``x != 0``).
In the common dense case no entry is exactly 0 and the ``positive`` plane alone is the sign.
NaN compares false with 0, so a NaN entry packs as "not positive, nonzero", i.e. -1.

On CPU the fast path is numpy (``greater`` into a reused bool buffer, then ``packbits``),
which runs at about memcpy speed; elsewhere (CUDA) it is device-agnostic torch code. The
``*_reference`` functions are slow, obviously-correct Python loops the tests hold the fast
paths to, bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = [
    "packed_size",
    "pack_signs",
    "pack_nonzero",
    "pack_planes",
    "pack_planes_checked",
    "unpack_signs",
    "pack_signs_reference",
    "pack_nonzero_reference",
    "unpack_signs_reference",
]

# dtypes whose CPU tensors numpy can view without a copy (bfloat16 has no numpy twin).
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def packed_size(numel: int) -> int:
    """Bytes that ``numel`` packed signs occupy."""
    return (numel + 7) // 8


def _check_float(x: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_sparse:
        raise ValueError(f"{what} is sparse; sign packing needs a dense tensor (sparse gradients are not supported)")
    if not x.is_floating_point():
        raise ValueError(f"{what} has dtype {x.dtype}; sign packing needs a floating-point tensor")
    return x.detach().reshape(-1)


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """bool[n] -> uint8[ceil(n/8)], little bit order."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = _bit_weights(bits.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)


# Entries per numpy pass (a multiple of 8): the chunk and its bool mask stay in cache, so
# packing both planes reads the tensor from memory once and allocates no n-byte temporary.
_CHUNK = 1 << 15


def _pack_numpy(xn: np.ndarray, predicates, check_finite: bool = False) -> tuple[list[torch.Tensor], bool]:
    """One plane per predicate (``np.greater`` / ``np.not_equal`` against 0), chunk by chunk,
    and (with ``check_finite``) whether every entry is finite, from each cached chunk's sum."""
    n = xn.size
    planes = [np.empty(packed_size(n), dtype=np.uint8) for _ in predicates]
    mask = np.empty(min(n, _CHUNK), dtype=np.bool_)
    finite = True
    for start in range(0, n, _CHUNK):
        chunk = xn[start : start + _CHUNK]
        m = mask[: chunk.size]
        first = start // 8
        for plane, predicate in zip(planes, predicates):
            predicate(chunk, 0, out=m)
            plane[first : first + packed_size(chunk.size)] = np.packbits(m, bitorder="little")
        if check_finite and finite:
            # A chunk's sum is finite when its entries are; overflow is settled entry-wise.
            with np.errstate(over="ignore", invalid="ignore"):
                total = chunk.sum(dtype=np.float32 if chunk.dtype == np.float16 else None)
            finite = bool(np.isfinite(total)) or bool(np.isfinite(chunk).all())
    return [torch.from_numpy(plane) for plane in planes], finite


def _pack(x: torch.Tensor, positive: bool, nonzero: bool) -> list[torch.Tensor]:
    x = _check_float(x)
    if x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS:
        predicates = [np.greater] * positive + [np.not_equal] * nonzero
        return _pack_numpy(x.numpy(), predicates)[0]
    # Device-agnostic path (CUDA; bfloat16 on CPU).
    return [_bits_to_bytes(x > 0)] * positive + [_bits_to_bytes(x != 0)] * nonzero


def pack_planes_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positive, nonzero, nonfinite)``: both planes and a 0-d bool "holds NaN or Inf",
    in one pass over ``x`` on CPU (what each rank does to its gradient before a vote)."""
    x = _check_float(x)
    if x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS:
        (positive, nonzero), finite = _pack_numpy(x.numpy(), [np.greater, np.not_equal], check_finite=True)
        return positive, nonzero, torch.tensor(not finite)
    from .collective import nonfinite_flag  # the device-agnostic check

    return _bits_to_bytes(x > 0), _bits_to_bytes(x != 0), nonfinite_flag(x)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x > 0`` into ``uint8[ceil(x.numel() / 8)]`` (see the module docstring)."""
    return _pack(x, positive=True, nonzero=False)[0]


def pack_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x != 0`` into ``uint8[ceil(x.numel() / 8)]``."""
    return _pack(x, positive=False, nonzero=True)[0]


def pack_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pack_signs(x), pack_nonzero(x))`` in one pass over ``x``."""
    positive, nonzero = _pack(x, positive=True, nonzero=True)
    return positive, nonzero


@functools.lru_cache(maxsize=None)
def _sign_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: row b holds the 8 entries byte b of a positive plane unpacks to (±1)."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 1.0, -1.0).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _ternary_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 4]: row ``p | (z << 4)`` for 4-bit nibbles p (positive) and z (nonzero)."""
    codes = torch.arange(256).unsqueeze(1)
    pos = (codes >> torch.arange(4)) & 1
    nonzero = (codes >> (torch.arange(4) + 4)) & 1
    return torch.where(nonzero.bool(), torch.where(pos.bool(), 1.0, -1.0), 0.0).to(dtype=dtype, device=device)


def _gather_rows(lut: torch.Tensor, idx: torch.Tensor, numel: int, out: torch.Tensor) -> None:
    """out[:numel] = lut[idx].flatten()[:numel], with no full-size temporary."""
    width = lut.shape[1]
    full = numel // width
    if full:
        torch.index_select(lut, 0, idx[:full], out=out[: full * width].view(full, width))
    tail = numel - full * width
    if tail:
        out[full * width :] = lut[idx[full].long(), :tail]


def unpack_signs(
    positive: torch.Tensor,
    numel: int,
    *,
    nonzero: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unpack to a float tensor of ``numel`` entries in {-1, 0, +1}.

    A set ``positive`` bit gives +1, a clear one -1, unless ``nonzero`` is given and its bit is
    clear, which gives +0.0. ``out`` (contiguous, ``numel`` entries, any float dtype) is written
    in place and returned; without it a new 1-D tensor of ``dtype`` on ``positive``'s device is.

    One table lookup per 8 entries (dense) or per 4 entries (with ``nonzero``: the two planes'
    nibbles make one 8-bit index), written straight into ``out``.
    """
    if positive.dtype != torch.uint8:
        raise ValueError(f"positive must be a uint8 tensor of packed bits, got {positive.dtype}")
    nbytes = packed_size(numel)
    if numel < 0 or positive.numel() < nbytes or (nonzero is not None and nonzero.numel() < nbytes):
        raise ValueError(f"{positive.numel()} packed bytes cannot hold numel={numel} entries")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=positive.device)
    elif out.numel() != numel or not out.is_contiguous() or not out.is_floating_point():
        raise ValueError(f"out must be a contiguous float tensor of {numel} entries")
    flat = out.view(-1)
    pos = positive[:nbytes]
    if nonzero is None:
        # index_select takes int32/int64 indices; the cast is 1/8 of the output's size.
        _gather_rows(_sign_lut(out.dtype, out.device), pos.to(torch.int32), numel, flat)
        return out
    nz = nonzero[:nbytes]
    idx = torch.empty(nbytes, 2, dtype=torch.int32, device=pos.device)  # [low nibble, high nibble]
    idx[:, 0] = (pos & 0x0F) | ((nz & 0x0F) << 4)
    idx[:, 1] = (pos >> 4) | (nz & 0xF0)
    _gather_rows(_ternary_lut(out.dtype, out.device), idx.view(-1), numel, flat)
    return out


# --- slow, obviously-correct references -------------------------------------------------


def _pack_reference(values: list[float], predicate) -> torch.Tensor:
    packed = [0] * packed_size(len(values))
    for i, v in enumerate(values):
        if predicate(v):
            packed[i // 8] |= 1 << (i % 8)
    return torch.tensor(packed, dtype=torch.uint8)


def pack_signs_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`pack_signs`: a Python loop over the entries."""
    return _pack_reference(x.detach().reshape(-1).double().cpu().tolist(), lambda v: v > 0)


def pack_nonzero_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`pack_nonzero`."""
    return _pack_reference(x.detach().reshape(-1).double().cpu().tolist(), lambda v: v != 0)


def unpack_signs_reference(positive: torch.Tensor, numel: int, nonzero: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`unpack_signs`, returning float32 on CPU."""
    pos = positive.cpu().tolist()
    nz = nonzero.cpu().tolist() if nonzero is not None else None
    values = []
    for i in range(numel):
        byte, bit = divmod(i, 8)
        if nz is not None and not (nz[byte] >> bit) & 1:
            values.append(0.0)
        else:
            values.append(1.0 if (pos[byte] >> bit) & 1 else -1.0)
    return torch.tensor(values, dtype=torch.float32)
