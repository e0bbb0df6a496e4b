"""Checkpoints of the sign-vote optimizers: each rank's momentum is its own (it runs before
the vote), so a state dict names the rank that saved it and its world size, can carry every
rank's state, and is checked against the optimizer (and, on several ranks, against every
rank's load) before anything is loaded."""

from __future__ import annotations

import weakref
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from signmuon.comm_hooks.dist import from_host, gather_rows, group_device, group_size_rank

__all__ = [
    "agree_to_load",
    "gather_next_state_dict",
    "keep_saved_dtypes",
    "load_rank_state",
    "rank_state_dict",
    "refuse_load",
]

_SAVE_PER_RANK = (
    "Save a file per rank (torch.save(opt.state_dict(), f'optimizer.rank{rank}.pt') on every rank, each loading its "
    "own), or create the optimizer with checkpoint_all_ranks=True, whose state_dict() (then a collective) gathers "
    "every rank's momentum into one file that every rank loads its part of"
)
_FOREIGN_MOMENTUM = (
    "the optimizer state of another rank is being loaded ({loads}; no rank loaded anything): each rank's momentum "
    "is its own, so every rank would resume with the saving rank's. {remedy}"
)
_GATHER_ONCE: weakref.WeakSet = weakref.WeakSet()  # optimizers whose next state_dict() gathers every rank's


def _to_cpu(state: dict) -> dict:
    return {k: {name: v.detach().cpu() if torch.is_tensor(v) else v for name, v in s.items()} for k, s in state.items()}


def gather_next_state_dict(optimizer) -> None:
    """Make ``optimizer``'s next ``state_dict()`` gather every rank's state, as ``checkpoint_all_ranks``
    makes every one: for a framework that calls ``state_dict()`` on every rank but writes only rank
    0's result (Accelerate's ``save_state``). Every rank calls it, then ``state_dict()``."""
    _GATHER_ONCE.add(optimizer)


def _gathers(optimizer) -> bool:
    once = optimizer in _GATHER_ONCE
    _GATHER_ONCE.discard(optimizer)
    return optimizer.checkpoint_all_ranks or once


def rank_state_dict(optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (torch's ``state_dict()``) with a ``"signmuon"`` entry: step count, whose state it
    is (rank in the voting group, world size) and, with ``checkpoint_all_ranks``, every rank's
    state (a collective)."""
    world_size, rank = group_size_rank(optimizer.process_group)
    state["signmuon"] = {"steps_taken": optimizer.steps_taken, "world_size": world_size, "rank": rank}
    if _gathers(optimizer) and world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, _to_cpu(state["state"]), group=optimizer.process_group)
        state["signmuon"]["rank_states"] = gathered
    return state


def load_rank_state(
    optimizer,
    state_dict: dict[str, Any],
    *,
    refusal: str | None = None,
    remedy: str = _SAVE_PER_RANK,
    digest: torch.Tensor | None = None,
) -> dict[str, Any]:
    """torch's part of ``state_dict`` for this rank, after checking that it fits ``optimizer``:
    the same world size, this rank's own momentum, param groups, and per parameter state keys,
    shapes and float dtypes (ValueError now, not at the next step).

    On several ranks, a state dict saved by :func:`rank_state_dict` is checked on every rank at
    once (one all-gather of five words: every rank loads, or every rank raises): a rank that
    refuses alone would leave the others to train on, or hang in the next collective.
    ``refusal``: one the caller found itself, agreed on like the others; ``remedy``: what the
    message for another rank's momentum tells the user to do instead; ``digest``: see
    :func:`agree_to_load`."""
    extra = state_dict.get("signmuon", {"steps_taken": 0})
    checked = "signmuon" in state_dict
    state_dict = {k: v for k, v in state_dict.items() if k != "signmuon"}
    world_size, rank = group_size_rank(optimizer.process_group)
    refusal = refusal or _world_refusal(extra, world_size)
    saved_rank = rank if "rank_states" in extra or not _per_rank_momentum(optimizer) else extra.get("rank", rank)
    if refusal is None and "rank_states" in extra:
        state_dict["state"] = extra["rank_states"][rank]
    if refusal is None and int(saved_rank) == rank:  # another rank's state: the message below says why
        refusal = _fit_refusal(optimizer, state_dict)
    if checked and world_size > 1:
        own = "rank_states" not in extra and _per_rank_momentum(optimizer)  # else any rank's state fits
        agree_to_load(optimizer.process_group, int(saved_rank), refusal, remedy, digest=digest if own else None)
    if refusal is not None:
        raise ValueError(refusal)
    return state_dict


def refuse_load(optimizer, error: Exception) -> NoReturn:
    """Raise ``error`` (this rank has no readable checkpoint: a missing or tampered file) after
    telling the other ranks, which wait in ``load_state_dict``'s check: every rank raises, none
    hangs. Call it on every rank that cannot reach ``load_state_dict``."""
    world_size, rank = group_size_rank(optimizer.process_group)
    if world_size > 1:
        agree_to_load(optimizer.process_group, rank, f"{type(error).__name__}: {error}")
    raise error


def _world_refusal(extra: dict[str, Any], world_size: int) -> str | None:
    saved_world = len(extra["rank_states"]) if "rank_states" in extra else extra.get("world_size", world_size)
    if saved_world == world_size:
        return None
    return (
        f"the checkpoint holds the local state of {saved_world} rank(s), but {world_size} rank(s) are "
        "loading it: each rank's momentum is its own, so resume on the same number of ranks"
    )


def _per_rank_momentum(optimizer) -> bool:
    """Whether this optimizer's state differs from rank to rank: its momentum (master weights and
    AdamW's state on the mean gradient are the same everywhere; SignSGDMV's buffer is overwritten)."""
    return any(group.get("momentum", 0) for group in optimizer.param_groups)


def _fit_refusal(optimizer, state_dict: dict[str, Any]) -> str | None:
    try:
        _check_fits(optimizer, state_dict)
    except ValueError as error:
        return str(error)
    return None


def agree_to_load(
    group,
    saved_rank: int,
    refusal: str | None = None,
    remedy: str = _SAVE_PER_RANK,
    *,
    foreign: str = _FOREIGN_MOMENTUM,
    digest: torch.Tensor | None = None,
) -> None:
    """Raise on every rank of ``group`` if any rank loads a state another rank saved (``saved_rank``,
    its rank in ``group``) or refuses its own (``refusal``): one all-gather of five words, on every
    rank before anything is loaded. ``foreign``: the message for another rank's state, formatted
    with ``loads`` (``"rank 1 loads rank 0's"``) and ``remedy``. ``digest``: for a state that does
    not say who saved it, three float64s that sum it (the third > 0), equal only for equal states:
    a rank whose digest equals a lower rank's loads that rank's."""
    _, rank = group_size_rank(group)
    device = group_device(group)
    sums = torch.zeros(3, dtype=torch.float64, device=device) if digest is None else digest.to(device, torch.float64)
    row = torch.cat([from_host([saved_rank, int(refusal is not None)], torch.int64, device), sums.view(torch.int64)])
    gathered = gather_rows(row, group).cpu()
    rows, sums = gathered[:, :2].tolist(), gathered[:, 2:].contiguous().view(torch.float64)
    for r in range(len(rows)):
        equal = [q for q in range(r) if sums[q, 2] > 0 and torch.equal(sums[q], sums[r])]
        rows[r][0] = equal[0] if equal else rows[r][0]
    others = [(r, saved) for r, (saved, _) in enumerate(rows) if saved != r]
    if others and (refusal is None or rows[rank][0] != saved_rank):  # one rank's state: the cause of any refusal
        loads = ", ".join(f"rank {r} loads rank {saved}'s" for r, saved in others)
        raise ValueError(foreign.format(loads=loads, remedy=remedy))
    refused = [r for r, (_, no) in enumerate(rows) if no and r != rank]
    if refused and refusal is None:
        raise ValueError(
            f"rank(s) {refused} cannot load their checkpoint (their error says why), so no rank loads its own"
        )


def _check_fits(optimizer, state_dict: dict[str, Any]) -> None:
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer {len(optimizer.param_groups)}"
        )
    saved_state = state_dict.get("state", {})
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {g} has {len(saved['params'])} parameters in the checkpoint, {len(group['params'])} here"
            )
        for index, p in zip(saved["params"], group["params"]):
            expected = optimizer.state[p]
            got = saved_state.get(index, {})
            label = f"parameter {index} (shape {tuple(p.shape)}, group {g})"
            if set(got) != set(expected):
                raise ValueError(f"{label}: the checkpoint's state has keys {sorted(got)}, expected {sorted(expected)}")
            for key, value in expected.items():
                loaded = got[key]
                if not torch.is_tensor(loaded) or loaded.shape != value.shape:
                    shape = tuple(loaded.shape) if torch.is_tensor(loaded) else type(loaded).__name__
                    raise ValueError(f"{label}: the checkpoint's {key} is {shape}, expected shape {tuple(value.shape)}")
                if not loaded.is_floating_point():
                    raise ValueError(
                        f"{label}: the checkpoint's {key} has dtype {loaded.dtype}, expected a float dtype"
                    )


def keep_saved_dtypes(optimizer, loaded: dict[str, Any]) -> None:
    """After torch's ``load_state_dict`` (which casts state to each parameter's dtype): put back
    the saved floating state as it was saved (float32 momentum of bfloat16 parameters stays float32)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in loaded["param_groups"] for i in g["params"]]
    for p, index in zip(params, saved_ids):
        device = (p.to_local() if hasattr(p, "to_local") else p).device
        for key, value in loaded["state"].get(index, {}).items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                optimizer.state[p][key] = value.detach().to(device=device, copy=True)
