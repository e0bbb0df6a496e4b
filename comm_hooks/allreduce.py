"""The full-precision mean all-reduce as DDP hooks use it: a future, bytes counted, and a rule
for a non-finite mean. The baseline every benchmark measures the vote against."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Callable

import torch
import torch.distributed as dist

from .dist import CommStats, NonFiniteError, mean_all_reduce, nonfinite_flag

__all__ = ["allreduce_mean", "allreduce_hook"]


def allreduce_mean(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    nonfinite: str | None = "skip",
    on_error: Callable[[NonFiniteError], None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce, in place) as a future; counts ring bytes.

    A non-finite mean (identical on every rank) is zeroed and counted in ``stats.skipped``
    (``nonfinite="skip"``), raises ``NonFiniteError`` (``"raise"``; handed to ``on_error``
    instead, with the mean zeroed, when given), or is left for the optimizer (``None``).
    """
    if stats is not None:
        stats.calls += 1
    work = mean_all_reduce(tensor, group, stats, async_op=True)

    def checked(mean: torch.Tensor) -> torch.Tensor:
        if nonfinite is not None and bool(nonfinite_flag(mean)):
            mean.zero_()
            if stats is not None:
                stats.skipped += 1
            if nonfinite == "raise":
                error = NonFiniteError("NaN or Inf in the all-reduced gradient (some rank's gradient was non-finite)")
                if on_error is None:
                    raise error
                on_error(error)
        return mean

    if work is None:  # a group of one
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(checked(tensor))
        return fut
    return work.get_future().then(lambda f: checked(f.value()[0]))


def allreduce_hook(state: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce over WORLD) with its bytes counted in ``state``.

    The fp32 baseline the benchmarks measure the vote against: ``model.register_comm_hook(CommStats(), allreduce_hook)``.
    """
    return allreduce_mean(bucket.buffer(), None, state)


