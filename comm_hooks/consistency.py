"""Cross-rank consistency checks: equal settings everywhere, identical replicas.

Both are one small all-gather. A rank with a different momentum, tie mode or period would
otherwise not hang but silently train a different algorithm; replicas that drift apart (a
hardware fault, a rank-dependent code path) would otherwise go unnoticed for days.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .exchange import group_size_rank

__all__ = ["ReplicaDivergenceError", "SettingsMismatchError", "check_replicas", "check_same_settings", "settings_digest"]


class SettingsMismatchError(ValueError):
    """Ranks were configured differently (raised on every rank alike)."""


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold identical parameters do not (raised on every rank alike)."""


def settings_digest(settings: Mapping) -> int:
    """A 63-bit digest of ``settings``, stable across processes and machines."""
    text = repr(sorted((str(k), repr(v)) for k, v in settings.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _gather_rows(row: torch.Tensor, group) -> torch.Tensor:
    world_size, _ = group_size_rank(group)
    rows = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def check_same_settings(
    settings: Mapping,
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "settings",
    device: torch.device | str | None = None,
) -> None:
    """Raise :class:`SettingsMismatchError` on every rank unless all ranks pass equal ``settings``.

    One all-gather of a 64-bit digest, on ``device`` (default: the current GPU under NCCL,
    else the CPU).
    """
    world_size, rank = group_size_rank(group)
    if world_size == 1:
        return
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    digests = _gather_rows(torch.tensor([settings_digest(settings)], dtype=torch.int64, device=device), group)
    digests = digests.view(-1).tolist()
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(settings.items(), key=lambda kv: str(kv[0])))
        raise SettingsMismatchError(
            f"{what} differ between ranks: rank(s) {differing} disagree with rank 0. "
            f"This rank ({rank}) has: {shown}"
        )


def _checksums(tensor: torch.Tensor) -> torch.Tensor:
    """[3] float64: sum, sum of squares, and a strided sum (catches most permutations)."""
    x = tensor.detach().reshape(-1).double()
    return torch.stack([x.sum(), (x * x).sum(), x[::7].sum()])


def check_replicas(
    tensors: Iterable[torch.Tensor] | torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    names: Sequence[str] | None = None,
) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank if any tensor differs between ranks.

    Compares per-tensor float64 checksums (one all-gather of 3 numbers per tensor); the
    error names the first divergent tensor (by ``names``, or the module's parameter names).
    """
    if isinstance(tensors, torch.nn.Module):
        named = list(tensors.named_parameters())
        names, tensors = [n for n, _ in named], [p for _, p in named]
    tensors = list(tensors)
    world_size, _ = group_size_rank(group)
    if world_size == 1 or not tensors:
        return
    local = torch.stack([_checksums(t) for t in tensors]).to(tensors[0].device)  # [T, 3]
    gathered = _gather_rows(local, group)  # [M, T, 3]
    differs = (gathered != gathered[0]).any(dim=2)  # [M, T]
    if bool(differs.any()):
        first = int(differs.any(dim=0).nonzero()[0])
        ranks = differs[:, first].nonzero().view(-1).tolist()
        label = names[first] if names else f"tensor {first} (shape {tuple(tensors[first].shape)})"
        raise ReplicaDivergenceError(f"replicas diverged: {label} differs on rank(s) {ranks} from rank 0")
