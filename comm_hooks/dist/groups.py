"""Process-group basics every layer shares: size and rank, a fixed-size all-gather, agreement
checks that fail on every rank alike, and the errors they raise."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from .stats import CommStats
from .host import from_host

__all__ = ["Agreement", "NonFiniteError", "VoteMismatchError", "agree", "barrier", "gather_rows", "group_device", "group_size_rank"]


class NonFiniteError(RuntimeError):
    """Some rank's tensor held NaN or Inf; raised on every rank alike (``nonfinite="raise"``)."""


class VoteMismatchError(ValueError):
    """Ranks entered the same collective with different tensors (raised on every rank alike)."""


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of ``group``; without an initialised default group the caller is alone.

    A group object answers for itself, so groups made outside ``torch.distributed``'s registry
    work too. torchft's reconfigurable groups answer ``size()`` for the current quorum but
    ``rank()`` from their construction: their current inner group (``parent``) knows the rank."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        return dist.get_world_size(), dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return dist.get_world_size(group), dist.get_rank(group)
    return group.size(), getattr(group, "parent", group).rank()


def _backend_name(group: dist.ProcessGroup | None) -> str:
    try:
        return dist.get_backend(group)
    except ValueError:  # outside torch.distributed's registry (torchft's groups): the group names itself
        return group.getBackendName() if hasattr(group, "getBackendName") else group.name()


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device of the tensors a collective on ``group`` takes: the current GPU under NCCL
    (also as ``"cpu:gloo,cuda:nccl"``, what a bare ``init_process_group()`` picks on a GPU
    machine, and torchft's NCCL groups), the accelerator a per-device backend names for it
    (``"xpu:xccl"``), else the CPU (gloo).

    Every tensor the library makes for a collective (flags, headers, distances, agreement rows)
    is made here: NCCL rejects CPU tensors, and a CPU tensor next to GPU work stalls the stream.
    """
    backend = _backend_name(group)
    if ":" in backend:  # a backend per device type
        pairs = [entry.split(":", 1) for entry in backend.split(",")]
        kind = next((device for device, name in pairs if device != "cpu" and name != "gloo"), "cpu")
    else:
        kind = "cuda" if "nccl" in backend else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu: the current device's index
    return torch.device(kind, module.current_device()) if hasattr(module, "current_device") else torch.device(kind)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` has come here (nothing for a group of one)."""
    if group_size_rank(group)[0] > 1:
        dist.barrier(group=group)


def gather_rows(
    row: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    *,
    inside_node: bool = False,
    async_op: bool = False,
):
    """[M, *row.shape]: every rank's ``row`` (an all-gather; ``row`` must have the same shape
    everywhere); its bytes are added to ``stats`` (as bytes inside a node where ``inside_node``).
    ``async_op``: (the rows, filled once the returned work handle is waited for; None alone)."""
    world_size, _ = group_size_rank(group)
    if world_size == 1:
        return (row.unsqueeze(0), None) if async_op else row.unsqueeze(0)
    if stats is not None:
        size = (world_size - 1) * row.numel() * row.element_size()
        stats.add(size, size, inside_node=inside_node)
    rows = row.new_empty(world_size, *row.shape)
    work = dist.all_gather(list(rows.unbind(0)), row.contiguous(), group=group, async_op=async_op)
    return (rows, work) if async_op else rows


def agree(fields: Mapping[str, int], group: dist.ProcessGroup | None, **options) -> list[list[int]]:
    """Raise :class:`VoteMismatchError` on every rank unless every rank passes equal ``fields``
    (``options``: :class:`Agreement`'s), waiting for the all-gather now.

    One all-gather of ``len(fields)`` int64 words: a fixed size, so ranks that disagree on any
    size still meet in it, unlike the collective they are about to enter. The error names every
    rank's values (``describe[name]`` formats a field's word). Call it with the same field
    names in the same order on every rank (the code at one call site does).

    ``carried``: int64 words (on the group's device, the same count on every rank) that ride in
    the same row uncompared, so what a caller gathers next needs no round trip of its own.
    Returns every rank's carried words (empty lists without ``carried``).
    """
    return Agreement(fields, group, **options).wait()


class Agreement:
    """:func:`agree` with its all-gather issued now and checked at :meth:`wait`: where nothing
    follows that the check must guard, so no rank waits for the others meanwhile."""

    def __init__(
        self,
        fields: Mapping[str, int],
        group: dist.ProcessGroup | None,
        *,
        what: str,
        describe: Mapping[str, Callable[[int], str]] | None = None,
        stats: CommStats | None = None,
        carried: torch.Tensor | None = None,
    ) -> None:
        self._names, self._what, self._describe = list(fields), what, describe or {}
        carried = torch.zeros(0, dtype=torch.int64, device=group_device(group)) if carried is None else carried
        row = torch.cat([from_host([int(v) for v in fields.values()], torch.int64, carried.device), carried])
        if group_size_rank(group)[0] == 1:
            self._rows, self._work = row.unsqueeze(0), None
        else:
            self._rows, self._work = gather_rows(row, group, stats, async_op=True)

    def wait(self) -> list[list[int]]:
        """Every rank's carried words, or :class:`VoteMismatchError` on every rank."""
        if self._work is not None:
            self._work.wait()
        gathered = self._rows.tolist()  # the one host read
        count = len(self._names)
        rows = [r[:count] for r in gathered]
        if all(r == rows[0] for r in rows):
            return [r[count:] for r in gathered]
        differing = [n for i, n in enumerate(self._names) if len({r[i] for r in rows}) > 1]

        def shown(name: str, word: int) -> str:
            return self._describe[name](word) if name in self._describe else str(word)

        per_rank = "; ".join(
            f"rank {rank}: " + ", ".join(f"{n}={shown(n, r[self._names.index(n)])}" for n in differing)
            for rank, r in enumerate(rows)
        )
        raise VoteMismatchError(f"ranks entered {self._what} with different {', '.join(differing)} ({per_rank})")
