"""Checkpoints of the sign-vote optimizers: each rank's momentum is its own (it runs before
the vote), so a state dict names its world size, can carry every rank's state, and is checked
against the optimizer before anything is loaded."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks.dist import group_size_rank

__all__ = ["keep_saved_dtypes", "load_rank_state", "rank_state_dict"]


def _to_cpu(state: dict) -> dict:
    return {k: {name: v.detach().cpu() if torch.is_tensor(v) else v for name, v in s.items()} for k, s in state.items()}


def rank_state_dict(optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (torch's ``state_dict()``) with a ``"signmuon"`` entry: step count, world size
    and, with ``checkpoint_all_ranks``, every rank's state (a collective)."""
    world_size, _ = group_size_rank(optimizer.process_group)
    state["signmuon"] = {"steps_taken": optimizer.steps_taken, "world_size": world_size}
    if optimizer.checkpoint_all_ranks and world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, _to_cpu(state["state"]), group=optimizer.process_group)
        state["signmuon"]["rank_states"] = gathered
    return state


def load_rank_state(optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's part of ``state_dict`` for this rank, after checking that it fits ``optimizer``:
    the same world size, param groups, and per parameter state keys, shapes and float dtypes
    (ValueError now, not at the next step)."""
    extra = state_dict.get("signmuon", {"steps_taken": 0})
    state_dict = {k: v for k, v in state_dict.items() if k != "signmuon"}
    world_size, rank = group_size_rank(optimizer.process_group)
    saved_world = len(extra["rank_states"]) if "rank_states" in extra else extra.get("world_size", world_size)
    if saved_world != world_size:
        raise ValueError(
            f"the checkpoint holds the local state of {saved_world} rank(s), but {world_size} rank(s) are "
            "loading it: each rank's momentum is its own, so resume on the same number of ranks"
        )
    if "rank_states" in extra:
        state_dict["state"] = extra["rank_states"][rank]
    _check_fits(optimizer, state_dict)
    return state_dict


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
