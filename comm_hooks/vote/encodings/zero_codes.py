"""How a shard's exact zeros travel (a rank abstains where its entry is 0): the three codes
and their planes, defined once for the sign encoding.

* a **zero list**: positions inside the shard as int32 pairs in int64 words, ``ceil(k/2)``
  words for k zeros (an odd count padded with -1);
* **zero runs**: (start, length) of each maximal run of consecutive zeros as int32 pairs, one
  word a run;
* a **zero plane**: the shard's ``nonzero`` plane itself.

:func:`zero_codes` picks the cheapest per shard (a list where it ties with runs) and writes its
header flag and length; :func:`extra_of` builds the extra a code announces and
:func:`plane_of` turns a received extra back into a ``nonzero`` plane.
"""

from __future__ import annotations

import torch

from ...kernels.bits import as_signed, shift_right
from ...kernels.torch_ops import popcount64
from .wire import EXTRA_SHIFT, with_extra
from .wire import FLAG_ZERO_LIST as ZERO_LIST
from .wire import FLAG_ZERO_PLANE as ZERO_PLANE
from .wire import FLAG_ZERO_RUNS as ZERO_RUNS

__all__ = [
    "ZEROS_SENT",
    "zero_positions",
    "plane_from_positions",
    "zero_runs",
    "plane_from_runs",
    "clear_bits",
    "list_positions",
    "zero_codes",
    "extra_of",
    "plane_of",
]

ZEROS_SENT = ZERO_LIST | ZERO_PLANE | ZERO_RUNS
POSITION_LIMIT = 1 << 31
"""Lists and runs hold positions inside a shard as int32: a shard of more entries sends its
zeros as a plane (exact at any size) instead of positions that would wrap."""


def zero_positions(nonzero: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """int64 positions (ascending) of the clear bits of ``nonzero`` int64 [S] words.

    With ``count`` (known on the host, e.g. from a header), exactly ``count`` positions, -1
    after the last clear bit: no host synchronisation (``nonzero_static``), where a plain
    ``nonzero`` must read its size back from the device."""
    if count is None:
        words = (nonzero != -1).nonzero().view(-1)
    else:  # a word of the sentinel (all bits set) stands in for the words past the last one
        padded = torch.cat([nonzero, nonzero.new_full((1,), -1)])
        words = torch.nonzero_static(padded != -1, size=min(count, nonzero.numel()), fill_value=nonzero.numel()).view(
            -1
        )
        nonzero = padded
    bits = torch.arange(64, device=nonzero.device)
    clear = ((~nonzero[words]).unsqueeze(1) >> bits) & 1  # [k_words, 64]
    if count is None:
        return (words.unsqueeze(1) * 64 + bits)[clear.bool()]
    flat = torch.nonzero_static(clear.view(-1), size=count, fill_value=-1).view(-1)
    return torch.where(flat >= 0, words[flat >> 6] * 64 + (flat & 63), -1)


def plane_from_positions(positions: torch.Tensor, words: int) -> torch.Tensor:
    """int64 [words] with every bit set but those at ``positions`` (distinct; -1 entries are padding)."""
    cleared = torch.zeros(words + 1, dtype=torch.int64, device=positions.device)  # word ``words``: padding's sink
    positions = torch.where(positions >= 0, positions, 64 * words)
    # Distinct powers of two: their sum per word is their OR.
    cleared.index_add_(0, positions >> 6, torch.ones_like(positions) << (positions & 63))
    return ~cleared[:words]


def _run_starts(nonzero: torch.Tensor) -> torch.Tensor:
    """Bits set where a run of clear bits of ``nonzero`` [..., S] words begins (a row's first
    bit counts as following a set one)."""
    zero = ~nonzero
    before = zero << 1  # bit k: entry k-1 is zero (within the word)
    before[..., 1:] |= shift_right(zero[..., :-1], 63)  # bit 0: the previous word's last entry
    return zero.bitwise_and_(before.bitwise_not_())


def _run_ends(nonzero: torch.Tensor) -> torch.Tensor:
    """Bits set at the last bit of each run of clear bits (padding bits past the data are set)."""
    zero = ~nonzero
    carry = torch.cat([zero[..., 1:] << 63, torch.zeros_like(zero[..., :1])], dim=-1)
    return zero & ~(shift_right(zero, 1) | carry)


def zero_runs(nonzero: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths), int64, of the runs of clear bits of ``nonzero`` int64 [S] words
    (``count``: their number, known on the host, as :func:`zero_positions` takes it)."""
    starts, ends = zero_positions(~_run_starts(nonzero), count), zero_positions(~_run_ends(nonzero), count)
    return starts, ends - starts + 1


def _low_bits(k: torch.Tensor) -> torch.Tensor:
    """Per entry, an int64 with its ``k`` lowest bits set (0 <= k <= 64)."""
    return torch.where(k >= 64, -1, (torch.ones_like(k) << k.clamp(max=63)) - 1)


def plane_from_runs(starts: torch.Tensor, lengths: torch.Tensor, words: int) -> torch.Tensor:
    """int64 [words] with every bit set but those in the runs (disjoint, as :func:`zero_runs` gives)."""
    stops = starts + lengths  # exclusive
    first, last = starts >> 6, (stops - 1) >> 6
    top = (stops - 1 & 63) + 1  # bits of the last word inside its run
    one_word = first == last
    # Runs are disjoint, so their masks in a shared edge word have distinct bits: a sum is an OR.
    cleared = torch.zeros(words, dtype=torch.int64, device=starts.device)
    head = ~_low_bits(starts & 63) & torch.where(one_word, _low_bits(top), -1)
    cleared.index_add_(0, first, head)
    cleared.index_add_(0, last[~one_word], _low_bits(top[~one_word]))
    inner = torch.zeros(words + 1, dtype=torch.int64, device=starts.device)  # words wholly inside a run
    inner.index_add_(0, first[~one_word] + 1, torch.ones_like(first[~one_word]))
    inner.index_add_(0, last[~one_word], -torch.ones_like(last[~one_word]))
    return ~(cleared | torch.where(inner.cumsum(0)[:words] > 0, -1, 0))


def _run_words(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Runs as int32 (start, length) pairs, one int64 word each."""
    return torch.stack([starts, lengths], dim=1).to(torch.int32).view(torch.int64).reshape(-1)


def _runs_from_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = words.view(torch.int32).view(-1, 2).to(torch.int64)
    return pairs[:, 0], pairs[:, 1]


def clear_bits(plane: torch.Tensor, lo: int, hi: int) -> None:
    """Clear bits ``lo .. hi-1`` of an int64 word plane."""
    first, last = lo >> 6, (hi - 1) >> 6
    low = lambda k: as_signed((1 << k) - 1)  # noqa: E731  the k lowest bits
    if first == last:
        plane[first] &= ~as_signed(((1 << (hi - lo)) - 1) << (lo & 63))
        return
    plane[first] &= low(lo & 63)
    plane[first + 1 : last] = 0
    plane[last] &= ~low(((hi - 1) & 63) + 1) if (hi & 63) else 0


def _list_words(positions: torch.Tensor) -> torch.Tensor:
    """Positions as int32 pairs in int64 words (an odd count padded with -1)."""
    as32 = positions.to(torch.int32)
    if as32.numel() % 2:
        as32 = torch.cat([as32, as32.new_full((1,), -1)])
    return as32.view(torch.int64)


def list_positions(words: torch.Tensor) -> torch.Tensor:
    """The positions a zero list holds, int64; the padding (-1) stays -1."""
    return words.view(torch.int32).to(torch.int64)


def zero_codes(planes: torch.Tensor, words: int) -> torch.Tensor:
    """Per row of ``nonzero`` planes [P, S]: flag and extra length of the cheapest zero encoding
    (a plane for shards too long for int32 positions, :data:`POSITION_LIMIT`)."""
    zeros = popcount64(~planes).sum(dim=1)  # [P]
    if 64 * words > POSITION_LIMIT:
        return torch.where(zeros > 0, with_extra(ZERO_PLANE, words), 0)
    runs = popcount64(_run_starts(planes)).sum(dim=1)
    list_len = (zeros + 1) // 2
    use_runs = (runs < list_len) & (runs < words)
    use_list = ~use_runs & (list_len < words)
    length = torch.where(use_runs, runs, torch.where(use_list, list_len, words))
    flag = torch.where(use_runs, ZERO_RUNS, torch.where(use_list, ZERO_LIST, ZERO_PLANE))
    return torch.where(zeros > 0, with_extra(flag, length), 0)


def extra_of(plane: torch.Tensor, code: int) -> torch.Tensor:
    """The extra that header ``code`` announces for a shard whose ``nonzero`` plane is ``plane``;
    its length, in the code, sizes it on the host (no synchronisation)."""
    if code & ZERO_PLANE:
        return plane
    length = code >> EXTRA_SHIFT
    if code & ZERO_RUNS:
        return _run_words(*zero_runs(plane, length))
    return _list_words(zero_positions(plane, 2 * length))  # k = 2·length or 2·length − 1 zeros: -1 pads


def plane_of(code: int, extra: torch.Tensor | None, words: int, device) -> torch.Tensor:
    """The ``nonzero`` plane of ``words`` words a received (code, extra) describes."""
    if code & ZERO_PLANE:
        return extra
    if code & ZERO_RUNS:
        return plane_from_runs(*_runs_from_words(extra), words)
    if code & ZERO_LIST:
        return plane_from_positions(list_positions(extra), words)
    return torch.full((words,), -1, dtype=torch.int64, device=device)
