"""Shared facts of the kernels: float bit layouts, word sizes, 64-bit word arithmetic and tie-break segments."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = [
    "FloatLayout",
    "FLOAT_LAYOUTS",
    "SignSegments",
    "data_words",
    "words_for",
    "MASK64",
    "GOLDEN",
    "mix64",
    "as_signed",
    "shift_right",
    "advance_momentum_unless",
    "advance_momentum_then_pack",
]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: consecutive keys land far apart


def mix64(z: int) -> int:
    """splitmix64's finaliser on a 64-bit unsigned int (the tie coins' hash, defined once)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def as_signed(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return value - (1 << 64) if value >> 63 else value


def shift_right(words: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words by ``k`` in [1, 63] (torch's ``>>`` is arithmetic)."""
    return (words >> k) & ((1 << (64 - k)) - 1)


@dataclasses.dataclass(frozen=True)
class FloatLayout:
    """How a float dtype's bits encode sign, zero, ±1 and non-finite values."""

    bits: int
    int_dtype: torch.dtype  # same-width signed integer, for a zero-copy view
    np_uint: type  # same-width numpy unsigned integer
    abs_mask: int  # every bit but the sign
    exp_mask: int  # exponent all ones: Inf (equal) or NaN (greater) in the magnitude
    plus_one: int
    minus_one: int


def _layout(bits: int, int_dtype: torch.dtype, np_uint: type, exp_bits: int, mant_bits: int) -> FloatLayout:
    bias = (1 << (exp_bits - 1)) - 1
    sign = 1 << (bits - 1)
    exp_mask = ((1 << exp_bits) - 1) << mant_bits
    one = bias << mant_bits
    return FloatLayout(bits, int_dtype, np_uint, sign - 1, exp_mask, one, one | sign)


FLOAT_LAYOUTS: dict[torch.dtype, FloatLayout] = {
    torch.float16: _layout(16, torch.int16, np.uint16, 5, 10),
    torch.bfloat16: _layout(16, torch.int16, np.uint16, 8, 7),
    torch.float32: _layout(32, torch.int32, np.uint32, 8, 23),
    torch.float64: _layout(64, torch.int64, np.uint64, 11, 52),
}


def advance_momentum_unless(buf: torch.Tensor, grad: torch.Tensor, weight: float, skip: torch.Tensor) -> None:
    """``buf.lerp_(grad, weight)`` (torch's rounding: one fma per entry) unless the 0-d bool
    ``skip`` is set. On CPU a branch; elsewhere a select on the device (no host synchronisation)."""
    if buf.device.type == "cpu":
        if not bool(skip):
            buf.lerp_(grad.to(buf.dtype), weight)
    else:
        buf.copy_(torch.where(skip, buf, buf.lerp(grad.to(buf.dtype), weight)))


def advance_momentum_then_pack(
    pack, buf: torch.Tensor, grad: torch.Tensor, weight: float, skip: torch.Tensor, words: int
):
    """A family's ``momentum_pack`` as two passes: :func:`advance_momentum_unless`, then ``pack(buf, words)``."""
    advance_momentum_unless(buf, grad, weight, skip)
    return pack(buf, words)


def data_words(numel: int) -> int:
    """64-bit words that hold ``numel`` packed entries (0 for none)."""
    return -(-numel // 64)


def words_for(numel: int) -> int:
    """64-bit words a packed tensor of ``numel`` entries travels in (at least one)."""
    return max(1, data_words(numel))


@dataclasses.dataclass(frozen=True)
class SignSegments:
    """How a flat voted tensor splits into named pieces, for tie-break bits.

    A tie (as many +1 as -1 voters) is broken by a bit drawn from a hash of the call key (seed
    and step), the piece's ``key`` (a parameter's stable number) and the entry's index inside
    the piece. So the bit an entry draws does not depend on where the piece sits in a DDP
    bucket, and a run resumed with another bucket layout draws the same bits.
    """

    starts: tuple[int, ...]
    """Entry offsets of the pieces in the flat tensor, plus its total length at the end."""
    keys: tuple[int, ...]
    """One non-negative key per piece."""
    offsets: tuple[int, ...] = ()
    """Per piece, the index of its first entry inside its tensor (a shard of it starting there),
    so a shard draws the coins of the same entries of the whole tensor; empty: all 0."""

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.keys) + 1 or not self.keys:
            raise ValueError("SignSegments needs one key per piece and len(keys) + 1 starts")
        if self.starts[0] != 0 or any(b < a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"segment starts {self.starts} must begin at 0 and not decrease")
        if any(k < 0 for k in self.keys):
            raise ValueError("segment keys must be non-negative")
        if self.offsets and (len(self.offsets) != len(self.keys) or min(self.offsets) < 0):
            raise ValueError("segment offsets must be empty or one non-negative offset per piece")

    @property
    def first_indices(self) -> tuple[int, ...]:
        """Each piece's ``offsets`` entry (0 where none are given)."""
        return self.offsets or (0,) * len(self.keys)

    @classmethod
    def whole(cls, numel: int, key: int = 0) -> "SignSegments":
        """One piece: the whole tensor."""
        return cls((0, numel), (key,))

    @classmethod
    def of_pieces(cls, sizes: list[int], keys: list[int], offsets: list[int] | None = None) -> "SignSegments":
        """Pieces of ``sizes`` entries laid end to end, keyed by ``keys`` (``offsets``: as the field)."""
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        return cls(tuple(starts), tuple(keys), tuple(offsets or ()))

    @property
    def numel(self) -> int:
        return self.starts[-1]
