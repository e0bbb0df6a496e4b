"""Sign bit packing: one bit per gradient entry.

Layout (the wire format of every collective in this package): entry ``8*j + k`` of the
flattened tensor is bit ``k`` (least significant first) of byte ``j``; a tensor of ``n``
entries packs into ``ceil(n / 8)`` bytes. The collectives work on the same bits as 64-bit
words (entry ``64*j + k`` at bit ``k`` of word ``j``, little-endian), where the padding bits
past the data are set.

Two planes describe a ternary sign: ``positive`` (``x > 0``) and ``nonzero`` (``x != 0``).
In the common dense case no entry is exactly 0 and the ``positive`` plane alone is the sign.
NaN compares false with 0, so a NaN entry packs as "not positive, nonzero", i.e. -1.

The byte-level functions here serve users and tests; they run on the kernels of
:mod:`signmuon.comm_hooks.kernels` (numba on CPU, Triton on CUDA). The tests hold them to
byte views of ``kernels.reference``.
"""

from __future__ import annotations

import torch

from ..kernels import kernels_for
from ..kernels.bits import FLOAT_LAYOUTS

__all__ = [
    "packed_size",
    "pack_signs",
    "pack_nonzero",
    "pack_planes",
    "pack_planes_checked",
    "unpack_signs",
    "bits_to_bytes",
    "check_float",
    "as_bytes",
    "as_words",
]


def packed_size(numel: int) -> int:
    """Bytes that ``numel`` packed signs occupy."""
    return (numel + 7) // 8


def check_float(x, what: str = "tensor") -> torch.Tensor:
    """``x`` flattened (contiguous), after checking it is a dense float tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise ValueError(
            f"{what} is sparse ({x.layout}); sign packing needs a dense tensor (sparse gradients are not supported)"
        )
    if x.dtype not in FLOAT_LAYOUTS:
        raise ValueError(
            f"{what} has dtype {x.dtype}; sign packing needs a floating-point tensor (fp16, bf16, fp32, fp64)"
        )
    return x.detach().reshape(-1).contiguous()


def bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """bool[n] -> uint8[ceil(n/8)], little bit order, high bits of the last byte clear."""
    words = -(-bits.numel() // 64) or 1
    plane = torch.zeros(words * 64, dtype=torch.bool, device=bits.device)
    plane[: bits.numel()] = bits.reshape(-1)
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=bits.device)
    return (plane.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)[: packed_size(bits.numel())]


def as_bytes(words: torch.Tensor, numel: int) -> torch.Tensor:
    """int64 words -> uint8 [ceil(numel/8)], padding bits of the last byte cleared."""
    out = words.view(torch.uint8)[: packed_size(numel)].clone()
    if numel % 8:
        out[-1] &= (1 << (numel % 8)) - 1
    return out


def as_words(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 packed bits -> int64 words (a copy, to get 8-byte alignment)."""
    words = max(1, -(-numel // 64))
    buf = torch.zeros(words * 8, dtype=torch.uint8, device=packed.device)
    buf[: packed_size(numel)] = packed[: packed_size(numel)]
    return buf.view(torch.int64)


def _pack(x: torch.Tensor):
    flat = check_float(x)
    words = max(1, -(-flat.numel() // 64))
    return flat.numel(), kernels_for(flat.device).pack(flat, words)


def pack_planes_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positive, nonzero, nonfinite)``: both planes and a 0-d bool "holds NaN or Inf",
    in one pass over ``x`` (what each rank does to its gradient before a vote)."""
    n, (positive, nonzero, _, nonfinite) = _pack(x)
    return as_bytes(positive, n), as_bytes(nonzero, n), torch.as_tensor(nonfinite)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x > 0`` into ``uint8[ceil(x.numel() / 8)]`` (see the module docstring)."""
    n, (positive, _, _, _) = _pack(x)
    return as_bytes(positive, n)


def pack_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x != 0`` into ``uint8[ceil(x.numel() / 8)]``."""
    n, (_, nonzero, _, _) = _pack(x)
    return as_bytes(nonzero, n)


def pack_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pack_signs(x), pack_nonzero(x))`` in one pass over ``x``."""
    n, (positive, nonzero, _, _) = _pack(x)
    return as_bytes(positive, n), as_bytes(nonzero, n)


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
    """
    if positive.dtype != torch.uint8:
        raise ValueError(f"positive must be a uint8 tensor of packed bits, got {positive.dtype}")
    nbytes = packed_size(numel)
    if numel < 0 or positive.numel() < nbytes or (nonzero is not None and nonzero.numel() < nbytes):
        raise ValueError(f"{positive.numel()} packed bytes cannot hold numel={numel} entries")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=positive.device)
    elif out.numel() != numel or not out.is_contiguous() or out.dtype not in FLOAT_LAYOUTS:
        raise ValueError(f"out must be a contiguous float tensor of {numel} entries")
    if numel:
        nz = None if nonzero is None else as_words(nonzero, numel)
        kernels_for(out.device).unpack(as_words(positive, numel), nz, out.view(-1))
    return out
