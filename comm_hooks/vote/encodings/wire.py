"""The wire format every encoded transport shares: the header words, defined once, and the plan.

Each row of a transport's first step starts with ``HEADER_WORDS`` int64 words; the rows of its
gather step (two-phase) with ``GATHER_HEADER_WORDS``:

====  ========  ==============================================================================
word  name      meaning
====  ========  ==============================================================================
0     code      bit 0 ``FLAG_NONFINITE``: this rank's input holds NaN or Inf (transport);
                bit 1 ``FLAG_ZERO_LIST``: the row's extra lists zero positions (encoding);
                bit 2 ``FLAG_ZERO_PLANE``: the row's extra is a nonzero plane (encoding);
                bit 3 ``FLAG_ZERO_RUNS``: the row's extra lists runs of zeros (encoding);
                bits 4-6: free for encodings;
                bit 7 ``FLAG_SENDS_EXTRA``: this rank sends an extra to some rank (transport);
                bits 8-63: the length of the row's extra in words (:func:`extra_words`)
1     value     an encoding's number (e.g. a float64 scale's bits)
2     shape     entry count (bits 0-55) and dtype code (bits 56-63)
3     tag       the caller's identity of the call (e.g. iteration and bucket)
====  ========  ==============================================================================

Gather rows carry words 0 and 1. Encodings set bits 1-6 and the length; the transport sets
bits 0 and 7 and reads the length to size the variable step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...kernels.bits import FLOAT_LAYOUTS

__all__ = [
    "AGREE_FIELDS",
    "HEADER_WORDS",
    "GATHER_HEADER_WORDS",
    "WORD_BYTES",
    "FLAG_NONFINITE",
    "FLAG_ZERO_LIST",
    "FLAG_ZERO_PLANE",
    "FLAG_ZERO_RUNS",
    "FLAG_SENDS_EXTRA",
    "EXCHANGE_FLAGS",
    "DTYPE_CODES",
    "Plan",
    "Encoded",
    "Encoding",
    "extra_words",
    "with_extra",
    "shape_word",
    "describe_shape",
]

AGREE_FIELDS = 3  # entries, dtype, tag: the words of a vote's agreement round
HEADER_WORDS = 4
GATHER_HEADER_WORDS = 2
WORD_BYTES = 8
FLAG_NONFINITE = 1
FLAG_ZERO_LIST = 2
FLAG_ZERO_PLANE = 4
FLAG_ZERO_RUNS = 8
FLAG_SENDS_EXTRA = 128
EXCHANGE_FLAGS = FLAG_NONFINITE | FLAG_SENDS_EXTRA
EXTRA_SHIFT = 8
DTYPE_CODES = {dtype: code for code, dtype in enumerate(FLOAT_LAYOUTS, start=1)}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def extra_words(code: int) -> int:
    """The length of a row's extra, in words, from its code word."""
    return code >> EXTRA_SHIFT


def with_extra(flags, length):
    """A code word from flags and an extra's length (ints or int64 tensors alike)."""
    return flags | (length << EXTRA_SHIFT)


def shape_word(numel: int, dtype: torch.dtype) -> int:
    return numel | (DTYPE_CODES[dtype] << 56)


def describe_shape(word: int) -> str:
    return f"{word & ((1 << 56) - 1)} entries of {_CODE_DTYPES.get(word >> 56, 'unknown dtype')}"


@dataclass(frozen=True)
class Plan:
    """How a tensor of ``numel`` entries is cut: ``parts`` rows of ``part_entries`` entries,
    each sent as ``words`` 64-bit words; ``two_phase`` says whether part r goes to rank r."""

    world_size: int
    rank: int
    numel: int
    parts: int
    part_entries: int
    words: int
    two_phase: bool


class Encoded(Protocol):
    rows: torch.Tensor  # int64 [parts, words]
    codes: torch.Tensor  # int64 [parts]: header word 0 (see the table)
    values: torch.Tensor  # int64 [parts]
    nonfinite: torch.Tensor | bool

    def extra(self, part: int, code: int) -> torch.Tensor: ...


class Encoding(Protocol):
    """What an encoding tells the transport (see ``SignEncoding``)."""

    def plan(self, numel: int, world_size: int, rank: int, two_phase: bool) -> Plan: ...

    def encode(self, flat: torch.Tensor, plan: Plan) -> Encoded: ...

    def reduce(
        self, rows: torch.Tensor, codes: list[int], values: list[int], extras: list, part: int, plan: Plan
    ) -> Encoded:
        """Reduce the M received rows of ``part`` into one (an ``Encoded`` with one part)."""

    def decode(
        self, rows: torch.Tensor, codes: list[int], values: list[int], extras: list, plan: Plan, out: torch.Tensor
    ) -> None: ...

    def plain_result(self, codes: list[int]) -> bool:
        """Whether every reduced part will carry code 0 and value 0, given that no rank sent an
        extra: then the transport skips reading step 3's headers (a host sync). It must answer
        alike on every rank: ``codes`` (the part this rank received) differ between ranks, their
        count (the voters) does not."""
