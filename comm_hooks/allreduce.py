"""The full-precision mean all-reduce as DDP hooks use it: a future, bytes counted, and a rule
for a non-finite mean. The baseline every benchmark measures the vote against."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from .dist import CommStats, NonFiniteError, mean_all_reduce, nonfinite_flag

__all__ = ["allreduce_hook", "allreduce_mean", "mean_all_reduce_future"]


def mean_all_reduce_future(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    nonfinite: str | None = "skip",
    on_error: Callable[[NonFiniteError, torch.Tensor], None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce, in place) as a future; counts ring bytes.

    A non-finite mean (identical on every rank) is zeroed and counted in ``stats.skipped``
    (``nonfinite="skip"``), raises ``NonFiniteError`` (``"raise"``; handed with its 0-d bool
    flag to ``on_error`` instead, with the mean zeroed, when given), or is left for the
    optimizer (``None``).

    Off the CPU the callback reads nothing to the host: NCCL completes a work's future at
    issue, so the callback runs inline, and a read there would stall backward on every bucket.
    The mean is zeroed on the device, the skip counted from a flag read when ``stats`` is, and
    ``on_error`` gets the flag unread (a hook state reads it once backward is done).
    """
    if stats is not None:
        stats.calls += 1
    work = mean_all_reduce(tensor, group, stats, async_op=True)

    def checked(mean: torch.Tensor) -> torch.Tensor:
        if nonfinite is None:
            return mean
        bad = nonfinite_flag(mean)
        if mean.device.type == "cpu":
            if not bool(bad):
                return mean
            mean.zero_()
        else:
            mean.masked_fill_(bad, 0)
        if stats is not None:
            stats.skip_if(bad)
        if nonfinite == "raise":
            error = NonFiniteError("NaN or Inf in the all-reduced gradient (some rank's gradient was non-finite)")
            if on_error is None:
                if bool(bad):
                    raise error
            else:
                on_error(error, bad)
        return mean

    if work is None:  # a group of one
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(checked(tensor))
        return fut
    return work.get_future().then(lambda _: checked(tensor))  # in place: the result is ``tensor``


def allreduce_hook(state: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction (mean all-reduce over WORLD) with its bytes counted in ``state``.

    The fp32 baseline the benchmarks measure the vote against: ``model.register_comm_hook(CommStats(), allreduce_hook)``.
    """
    return mean_all_reduce_future(bucket.buffer(), None, state)


def allreduce_mean(*args, **options) -> torch.futures.Future[torch.Tensor]:
    """The name :func:`mean_all_reduce_future` had until signmuon 0.1; it goes in 0.3."""
    warnings.warn(
        "allreduce_mean is now mean_all_reduce_future (signmuon.comm_hooks), the same call; "
        "the old name is removed in signmuon 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return mean_all_reduce_future(*args, **options)
