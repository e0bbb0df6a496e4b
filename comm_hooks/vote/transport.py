"""The transport: how encoded shards travel, independent of what the encoding is.

Every collective in this package that reduces a tensor at a fraction of a bit per entry has
the same schedule; an *encoding* (``encoding``) says what a shard
holds and how shards are reduced and decoded, this module moves them.

Two-phase (M >= 3 ranks by default; ``algorithm="two_phase"``)::

    1. all-to-all of fixed rows:   rank r gets part r of every rank  [M, 4 + S] int64 words
    1b. only if some header says so: all-to-all of variable extras (e.g. zero positions)
    2. reduce part r (the encoding)
    3. all-gather of the reduced parts                                [M, 2 + S] int64 words
    3b. only if some header says so: all-gather of variable extras
    4. decode (the encoding) straight into the output

All-gather (M = 2 by default): every rank gathers every rank's whole row (one part of
``S = W`` words), reduces all of it and decodes; the same bytes as two-phase for two ranks,
in one round.

Headers (``wire`` defines their words in one table). Each row of step 1 starts with four
words: ``code`` (flags and the length of the row's extra), ``value``, ``shape`` (entry count and
dtype) and ``tag`` (the caller's identity of the call, e.g. iteration and bucket). Every rank receives a row from every rank,
so all ranks see the same headers and take the same decisions with no extra round trip: skip
or raise on non-finite input, and raise :class:`VoteMismatchError` on every rank when ranks
disagree on shape, dtype or tag. Step 3's rows carry ``code`` and ``value``.

Sizes. Step 1's rows are as long as the tensor needs, so ranks with tensors of different word
counts would enter it with different sizes, which a process group cannot survive (gloo aborts
the process, NCCL hangs). Unless the caller knows the sizes agree (a DDP hook: DDP gives every
rank the same bucket layout), an :func:`agree` round first all-gathers a fixed-size row of
entry count, dtype and tag, and raises :class:`VoteMismatchError` on every rank naming each
rank's values. It is one tiny collective, hence one latency, per call.

Reading the headers is the one host synchronisation per transport step on a GPU: it decides the
sizes of the optional extras and the skip, which the host must know to issue the next
collective. Step 3's headers are not read where what every rank learnt alike in step 1 says
that no reduced part carries an extra: no rank sent one (each sender's ``FLAG_SENDS_EXTRA``), and
the encoding's ``plain_result`` (for the vote: no tie that votes 0). So the common vote reads the
host once. Collectives are issued only by the thread that calls the stage methods, in call
order (gloo pairs collectives by issue order; see ``VoteWork``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..dist import CommStats, NonFiniteError, VoteMismatchError, agree, all_to_all, group_size_rank, host_words
from .encodings.wire import (
    AGREE_FIELDS,
    DTYPE_CODES,
    EXCHANGE_FLAGS,
    FLAG_NONFINITE,
    FLAG_SENDS_EXTRA,
    GATHER_HEADER_WORDS,
    HEADER_WORDS,
    WORD_BYTES,
    Encoding,
    describe_shape,
    extra_words,
    shape_word,
)

__all__ = ["TransportWork", "default_two_phase", "transport_bytes_per_rank"]


class TransportWork:
    """One encoded reduction in flight, advanced in stages by its caller.

    ``TransportWork(...)`` encodes and starts step 1; :meth:`advance` waits for it, reduces this
    rank's part and starts step 3; :meth:`wait` finishes and returns ``out``. A DDP hook
    interleaves the stages of consecutive buckets to overlap them with backward.

    ``agree_sizes=False`` skips the :func:`agree` round; pass it only where every rank's entry
    count is equal by construction, or a mismatch aborts the process group.
    """

    __slots__ = (
        "_encoding",
        "_group",
        "_plan",
        "_stats",
        "_nonfinite",
        "_label",
        "_tag",
        "_out",
        "_device",
        "_encoded",
        "_recv",
        "_work",
        "_reduced",
        "_stage",
        "_skipped",
        "_plain",
    )

    def __init__(
        self,
        encoding: Encoding,
        flat: torch.Tensor,
        group: dist.ProcessGroup | None,
        *,
        out: torch.Tensor,
        two_phase: bool,
        stats: CommStats | None = None,
        nonfinite: str = "skip",
        label: str = "",
        tag: int = 0,
        input_nonfinite: torch.Tensor | None = None,
        agree_sizes: bool = True,
    ) -> None:
        world_size, rank = group_size_rank(group)
        if agree_sizes and world_size > 1:
            agree(
                {"entries": flat.numel(), "dtype": DTYPE_CODES[flat.dtype], "tag": tag & ((1 << 63) - 1)},
                group,
                what=label or "the same collective",
                describe={"dtype": lambda code: describe_shape(code << 56).split(" of ")[1]},
                stats=stats,
            )
        self._encoding, self._group, self._stats = encoding, group, stats
        self._nonfinite, self._label, self._tag, self._out = nonfinite, label, tag & ((1 << 63) - 1), out
        self._device = flat.device
        self._plan = plan = encoding.plan(flat.numel(), world_size, rank, two_phase and world_size > 1)
        self._stage, self._skipped, self._reduced, self._plain = 0, False, None, False
        if stats is not None:
            stats.calls += 1
        start = time.perf_counter()
        self._encoded = enc = encoding.encode(flat, plan)
        parts = plan.parts
        header = torch.empty(parts, HEADER_WORDS, dtype=torch.int64, device=flat.device)
        nonfinite = torch.as_tensor(enc.nonfinite, device=flat.device)
        if input_nonfinite is not None:
            nonfinite = nonfinite | input_nonfinite.to(flat.device)
        sends_extra = (extra_words(enc.codes).sum() > 0).to(torch.int64) * FLAG_SENDS_EXTRA
        header[:, 0] = enc.codes | nonfinite.to(torch.int64) * FLAG_NONFINITE | sends_extra
        header[:, 1] = enc.values
        header[:, 2] = shape_word(flat.numel(), flat.dtype)
        header[:, 3] = self._tag
        send = torch.cat([header, enc.rows], dim=1)  # [parts, 4 + S]
        self._time("pack_seconds", start)
        M = plan.world_size
        if M == 1:
            self._recv, self._work = send, None
        elif plan.two_phase:
            self._recv = torch.empty_like(send)
            self._work = dist.all_to_all_single(self._recv, send, group=group, async_op=True)
            self._account((M - 1) * send.shape[1], (M - 1) * send.shape[1])
        else:
            row = send.squeeze(0)
            self._recv = row.new_empty(M, row.numel())
            self._work = dist.all_gather(list(self._recv.unbind(0)), row, group=group, async_op=True)
            self._account((M - 1) * row.numel(), (M - 1) * row.numel())

    def _time(self, field: str, start: float) -> float:
        """Add the seconds since ``start`` to ``field`` of the statistics; returns now."""
        now = time.perf_counter()
        if self._stats is not None:
            setattr(self._stats, field, getattr(self._stats, field) + now - start)
        return now

    def _account(self, sent_words: int, received_words: int) -> None:
        if self._stats is not None:
            self._stats.add(sent_words * WORD_BYTES, received_words * WORD_BYTES)

    def _check_headers(self, headers: list[list[int]]) -> None:
        shapes = [h[2] for h in headers]
        tags = [h[3] for h in headers]
        if len(set(shapes)) > 1 or len(set(tags)) > 1:
            described = "; ".join(
                f"rank {r}: {describe_shape(s)}, tag {t}" for r, (s, t) in enumerate(zip(shapes, tags))
            )
            differ = "tensors" if len(set(shapes)) > 1 else "calls (tags)"
            raise VoteMismatchError(
                f"ranks entered {self._label or 'the same collective'} with different {differ} ({described}); "
                "every rank must pass the same entry count and dtype in the same call order"
            )

    def _nothing(self) -> torch.Tensor:
        """An empty extra: what a rank sends where it has none."""
        return torch.empty(0, dtype=torch.int64, device=self._device)

    def _send_extras(self, lengths_from: list[int], mine: list[torch.Tensor], broadcast: bool) -> list:
        """Variable-size all-to-all: ``mine[d]`` goes to rank d (or ``mine[0]`` to all if
        ``broadcast``); returns what each rank sent here (None where it sent nothing)."""
        M = self._plan.world_size
        if M == 1:
            return [mine[0] if lengths_from[0] else None]
        outgoing = [mine[0] if broadcast else mine[d] for d in range(M)]
        recv = all_to_all(torch.cat(outgoing), [t.numel() for t in outgoing], lengths_from, self._group, self._stats)
        pieces = list(recv.split(lengths_from))
        return [p if n else None for p, n in zip(pieces, lengths_from)]

    def advance(self) -> None:
        """Wait for step 1, reduce this rank's part, start step 3."""
        if self._stage >= 1:
            return
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        plan, M = self._plan, self._plan.world_size
        enc = self._encoded
        ours = plan.two_phase and getattr(enc, "zero_planes", None) is not None  # what we may send each rank
        words = self._recv[:, :HEADER_WORDS].reshape(-1)
        words = host_words(torch.cat([words, enc.codes]) if ours else words)  # the one host sync of this step
        headers = [words[r * HEADER_WORDS : (r + 1) * HEADER_WORDS] for r in range(M)]
        sending = words[M * HEADER_WORDS :] if ours else [0] * M
        start = self._time("wait_seconds", start)
        self._check_headers(headers)
        bad_ranks = [r for r, h in enumerate(headers) if h[0] & FLAG_NONFINITE]
        if bad_ranks:  # every rank sees the same headers, so all take this branch together
            self._stage, self._skipped = 1, True
            if self._stats is not None:
                self._stats.skipped += 1
            if self._nonfinite == "raise":
                raise NonFiniteError(f"NaN or Inf in {self._label or 'the voted tensor'} on rank(s) {bad_ranks}")
            return
        codes = [h[0] & ~EXCHANGE_FLAGS for h in headers]
        lengths = [extra_words(c) for c in codes]
        extras: list = [None] * M
        if any(h[0] & FLAG_SENDS_EXTRA for h in headers):  # the same decision on every rank
            if plan.two_phase:
                mine = [enc.extra(d, sending[d]) if extra_words(sending[d]) else self._nothing() for d in range(M)]
            else:
                mine = [enc.extra(0, codes[plan.rank]) if lengths[plan.rank] else self._nothing()]
            start = self._time("pack_seconds", start)  # encoding the extras
            extras = self._send_extras(lengths, mine, broadcast=not plan.two_phase)
            start = self._time("wait_seconds", start)  # a blocking collective
        part = plan.rank if plan.two_phase else 0
        rows = self._recv[:, HEADER_WORDS:]
        reduced = self._encoding.reduce(rows, codes, [h[1] for h in headers], extras, part, plan)
        self._time("vote_seconds", start)
        self._encoded = None
        if plan.two_phase:
            send = torch.cat([torch.stack([reduced.codes[0], reduced.values[0]]), reduced.rows[0]])  # [2 + S]
            self._recv = send.new_empty(M, send.numel())
            self._work = dist.all_gather(list(self._recv.unbind(0)), send, group=self._group, async_op=True)
            self._account((M - 1) * send.numel(), (M - 1) * send.numel())
        self._reduced = reduced
        # Alike on every rank: each sender's FLAG_SENDS_EXTRA is in all its rows, while the codes
        # describe the part this rank received (two-phase: a different part on each rank).
        self._plain = not any(h[0] & FLAG_SENDS_EXTRA for h in headers) and getattr(
            self._encoding, "plain_result", lambda _: False
        )(codes)
        self._stage = 1

    def wait(self) -> torch.Tensor:
        """Finish (issuing any remaining collectives) and return the output tensor."""
        if self._stage == 2:
            return self._out
        self.advance()
        plan = self._plan
        if self._skipped:
            self._out.zero_()
        elif plan.two_phase:
            start = time.perf_counter()
            self._work.wait()
            if self._plain:  # known from step 1's headers on every rank: no read
                headers = [[0] * GATHER_HEADER_WORDS] * plan.world_size
            else:
                words = host_words(self._recv[:, :GATHER_HEADER_WORDS].reshape(-1))  # host sync: extras' sizes
                headers = [
                    words[r * GATHER_HEADER_WORDS : (r + 1) * GATHER_HEADER_WORDS] for r in range(plan.world_size)
                ]
            codes = [h[0] for h in headers]
            lengths = [extra_words(c) for c in codes]
            extras: list = [None] * plan.world_size
            start = self._time("wait_seconds", start)
            if any(lengths):
                own = self._reduced.extra(0, codes[plan.rank]) if lengths[plan.rank] else self._nothing()
                start = self._time("vote_seconds", start)  # encoding the voted part's extra
                extras = self._send_extras(lengths, [own], broadcast=True)
                start = self._time("wait_seconds", start)
            rows = self._recv[:, GATHER_HEADER_WORDS:]
            self._encoding.decode(rows, codes, [h[1] for h in headers], extras, plan, self._out)
            self._time("unpack_seconds", start)
        else:
            start = time.perf_counter()
            reduced = self._reduced
            if self._plain:
                code, value = 0, 0
            else:
                code, value = host_words(torch.stack([reduced.codes[0], reduced.values[0]]))  # one host sync
            extras = [reduced.extra(0, code) if extra_words(code) else None]
            self._encoding.decode(reduced.rows, [code], [value], extras, plan, self._out)
            self._time("unpack_seconds", start)
        self._stage = 2
        self._recv = self._work = self._reduced = self._encoded = None  # free buffers
        return self._out

    @property
    def advanced(self) -> bool:
        """Whether :meth:`advance` has run (step 3, if any, is in flight)."""
        return self._stage >= 1

    @property
    def skipped(self) -> bool:
        """Whether some rank's input held NaN or Inf, so the vote was skipped (known once advanced)."""
        return self._skipped

    def is_completed(self) -> bool:
        return self._stage == 2

    @property
    def two_phase(self) -> bool:
        """Whether a second collective follows the first (issued by :meth:`advance`)."""
        return self._plan.two_phase

    @property
    def in_flight(self) -> dist.Work | None:
        """The collective of the stage started last while this work is unfinished (None: none)."""
        return self._work if self._stage < 2 else None


def transport_bytes_per_rank(plan_words: int, world_size: int, two_phase: bool, agree_sizes: bool = True) -> int:
    """Bytes one rank sends per call when no extras travel (the dense formula), with the
    agreement round's ``AGREE_FIELDS`` words per peer unless ``agree_sizes`` is off."""
    if world_size == 1:
        return 0
    agreement = AGREE_FIELDS if agree_sizes else 0
    if two_phase:
        return (world_size - 1) * (2 * plan_words + HEADER_WORDS + GATHER_HEADER_WORDS + agreement) * WORD_BYTES
    return (world_size - 1) * (plan_words + HEADER_WORDS + agreement) * WORD_BYTES


def default_two_phase(algorithm: str, world_size: int) -> bool:
    """``"auto"``: all-gather for two ranks (the same bytes in one round), two-phase above."""
    if algorithm == "auto":
        return world_size > 2
    return algorithm == "two_phase"
