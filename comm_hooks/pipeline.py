"""The votes of one backward pass still in flight (:class:`VotePipeline`): what lets a DDP hook
overlap a bucket's transport with the next bucket's backward."""

import collections
from collections.abc import Callable

import torch

from .dist import NonFiniteError
from .vote import NodeVoteWork, OwnedVoteWork, VoteWork

__all__ = ["VotePipeline"]


class VotePipeline:
    """The votes of one backward pass still in flight, oldest first, advanced a stage at a time.

    Collectives are issued here, on the autograd thread, oldest bucket first, so every rank
    issues the same sequence; a vote's second transport step thus overlaps the next bucket's
    backward. A ``NonFiniteError`` (raised on every rank alike) goes to ``defer`` and the bucket
    is zeroed; any other error fails every pending future, so DDP never waits forever. A vote
    skipped for NaN or Inf hands DDP what ``skipped(tensor)`` makes of its zeroed result.
    """

    __slots__ = ("_pending", "_defer", "_skipped")

    def __init__(
        self,
        defer: Callable[[NonFiniteError], None],
        skipped: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self._pending: collections.deque[
            tuple[VoteWork | NodeVoteWork | OwnedVoteWork, torch.futures.Future, Callable | None]
        ] = collections.deque()
        self._defer = defer
        self._skipped = skipped

    def add(self, work, fut: torch.futures.Future, finish: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Track ``work``, whose result (mapped by ``finish``) completes DDP's ``fut``."""
        self._pending.append((work, fut, finish))

    def advance(self, drain: bool = False) -> None:
        """Move every pending vote one stage on (all of them to the end if ``drain``)."""
        remaining: collections.deque = collections.deque()
        try:
            for work, fut, finish in self._pending:
                if drain or work.advanced:
                    voted = self._advance(work, to_end=True)
                    result = voted if finish is None else finish(voted)
                    if self._skipped is not None and work.skipped:
                        result = self._skipped(result)
                    fut.set_result(result)
                else:
                    self._advance(work, to_end=False)
                    remaining.append((work, fut, finish))
        except BaseException as error:
            for _, fut, _ in self._pending:
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()
            raise
        self._pending = remaining

    def _advance(self, work, to_end: bool) -> torch.Tensor | None:
        try:
            return work.wait() if to_end else work.advance()
        except NonFiniteError as error:  # raised on every rank alike; the work is now skipped
            self._defer(error)
            return work.wait() if to_end else None
