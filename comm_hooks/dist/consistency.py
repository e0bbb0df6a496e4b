"""Cross-rank consistency checks: equal settings everywhere, identical replicas.

Both are one small all-gather (two when replicas differ, to name the tensor). A rank with a different momentum, tie mode or period would
otherwise not hang but silently train a different algorithm; replicas that drift apart (a
hardware fault, a rank-dependent code path) would otherwise go unnoticed for days.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .groups import VoteMismatchError, gather_rows, group_device, group_size_rank

__all__ = [
    "ReplicaDivergenceError",
    "SettingsMismatchError",
    "check_replicas",
    "check_same_settings",
    "settings_digest",
    "tensor_fingerprint",
]


class SettingsMismatchError(ValueError):
    """Ranks were configured differently (raised on every rank alike)."""


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold identical parameters do not (raised on every rank alike)."""


def _canonical(value) -> str:
    """Text of ``value`` in which equal numbers read alike (``np.float64(0.001)``, ``0.001``; ``2``, ``2.0``)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        number = float(value)
        return repr(int(number)) if number.is_integer() else repr(number)
    if isinstance(value, Mapping):
        return (
            "{"
            + ", ".join(
                f"{_canonical(k)}: {_canonical(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            )
            + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    return repr(value)


def settings_digest(settings: Mapping) -> int:
    """A 63-bit digest of ``settings``, stable across processes and machines; numbers compare
    by value, so a setting given as ``np.float64(0.001)`` on one rank and ``0.001`` on another agrees."""
    text = _canonical(dict(settings))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def check_same_settings(
    settings: Mapping,
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "settings",
) -> None:
    """Raise :class:`SettingsMismatchError` on every rank unless all ranks pass equal ``settings``.

    One all-gather of a 64-bit digest, on the group's device (:func:`group_device`).
    """
    world_size, rank = group_size_rank(group)
    if world_size == 1:
        return
    digests = gather_rows(
        torch.tensor([settings_digest(settings)], dtype=torch.int64, device=group_device(group)), group
    )
    digests = digests.view(-1).tolist()
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        # Rare and fatal: a second gather of every rank's settings, to name the differing fields.
        everyone = _gather_texts(_leaves(settings), group)
        raise SettingsMismatchError(
            f"{what} differ between ranks in {_differences(everyone)} (rank(s) {differing} disagree with rank 0; "
            f"this is rank {rank}): pass the same settings on every rank"
        )


def _leaves(value, path: str = "") -> dict[str, str]:
    """Every setting as (dotted path, canonical text): nested settings (an optimizer's param
    groups) are named down to the field that differs, ``optimizer.groups[0].lr``."""
    if isinstance(value, Mapping) and value:
        out: dict[str, str] = {}
        for key, item in sorted(value.items(), key=lambda kv: str(kv[0])):
            out.update(_leaves(item, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in value):
        out = {}
        for index, item in enumerate(value):
            out.update(_leaves(item, f"{path}[{index}]"))
        return out
    return {path: _canonical(value)}


def _gather_texts(fields: dict[str, str], group: dist.ProcessGroup | None) -> list[dict[str, str]]:
    """Every rank's ``fields``: their JSON's bytes, padded to the longest (two fixed-size gathers)."""
    device = group_device(group)
    raw = torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8, device=device)
    lengths = gather_rows(torch.tensor([raw.numel()], dtype=torch.int64, device=device), group).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: raw.numel()] = raw
    rows = gather_rows(padded, group).cpu()
    return [json.loads(bytes(row[:n].tolist()).decode()) for row, n in zip(rows, lengths)]


def _differences(everyone: list[dict[str, str]]) -> str:
    """The fields whose values differ between ranks, each with every rank's value (``momentum``
    (rank 0: 0.9, rank 1: 0.5)); a field some ranks lack reads ``missing``."""
    fields = sorted({key for ranks_settings in everyone for key in ranks_settings})
    parts = []
    for key in fields:
        values = [ranks_settings.get(key, "missing") for ranks_settings in everyone]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))
            parts.append(f"{key} ({shown})")
    return "; ".join(parts) or "their settings"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed 64-bit word
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """0-d int64: a position-sensitive hash of ``tensor``'s raw bytes (its bits, not its values).

    Each 64-bit word is mixed with its position (splitmix64) and the mixes are summed with
    wrap-around, so a 1-ulp change anywhere, swapped entries or swapped halves all change it,
    and identical NaNs hash alike. One pass on the tensor's device; no host synchronisation.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 8:
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    words = raw.view(torch.int64)  # [w]
    x = words ^ (torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device) * _GOLDEN)
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return x.sum()


def _meta_word(tensor: torch.Tensor) -> int:
    text = f"{tensor.dtype}{tuple(tensor.shape)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def check_replicas(
    tensors: Iterable[torch.Tensor] | torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    names: Sequence[str] | None = None,
) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank unless every tensor is bit-identical
    on every rank.

    Compares :func:`tensor_fingerprint` of each tensor, with its dtype and shape: one all-gather
    of two words (tensor count and a digest of all fingerprints) when the replicas agree, and a
    second of two words per tensor to name the first differing tensor when they do not. Ranks
    passing different numbers of tensors raise :class:`VoteMismatchError` on every rank.
    """
    if isinstance(tensors, torch.nn.Module):
        named = list(tensors.named_parameters())
        names, tensors = [n for n, _ in named], [p for _, p in named]
    tensors = list(tensors)
    world_size, _ = group_size_rank(group)
    if world_size == 1:
        return
    device = group_device(group)
    if tensors:
        prints = torch.stack([tensor_fingerprint(t).to(device) for t in tensors])  # [T]
        metas = torch.tensor([_meta_word(t) for t in tensors], dtype=torch.int64, device=device)  # [T]
        local = torch.stack([prints, metas], dim=1)  # [T, 2]
        digest = tensor_fingerprint(local)
    else:
        local = torch.zeros(0, 2, dtype=torch.int64, device=device)
        digest = torch.zeros((), dtype=torch.int64, device=device)
    summary = gather_rows(torch.stack([torch.tensor(len(tensors), device=device), digest]), group).tolist()  # [M, 2]
    counts = [row[0] for row in summary]
    if len(set(counts)) > 1:
        raise VoteMismatchError(
            "ranks entered check_replicas with different numbers of tensors ("
            + "; ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            + ")"
        )
    if all(row[1] == summary[0][1] for row in summary):
        return
    gathered = gather_rows(local, group)  # [M, T, 2]
    differs = (gathered != gathered[0]).any(dim=2)  # [M, T]
    first = int(differs.any(dim=0).nonzero()[0])
    ranks = differs[:, first].nonzero().view(-1).tolist()
    label = names[first] if names else f"tensor {first} (shape {tuple(tensors[first].shape)})"
    how = "dtype or shape" if bool((gathered[:, first, 1] != gathered[0, first, 1]).any()) else "bits"
    raise ReplicaDivergenceError(f"replicas diverged: {label} differs in its {how} on rank(s) {ranks} from rank 0")
