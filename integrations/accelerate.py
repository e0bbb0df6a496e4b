"""Accelerate: register our hooks on the model ``accelerator.prepare`` returns.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own hook
names and ignores any other hook without a word, and ``prepare`` wraps the optimizer in an
``AcceleratedOptimizer`` that does not pass ``register_comm_hook`` through. One call after
``prepare`` does it::

    from accelerate import Accelerator
    from signmuon.integrations.accelerate import register_comm_hook

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(net, SignMuon(net.parameters(), lr=2e-3), loader)
    register_comm_hook(accelerator, model, optimizer)           # SignMuon / SignumMV / SignSGDMV
    # or, for the bare hook with any optimizer:
    # register_comm_hook(accelerator, model, optimizer, comm_state=SignVoteState(momentum=0.9))

Each rank's momentum is its own, and ``accelerator.save_state`` writes the optimizer from the
main process alone, which every rank loads at ``load_state``. After ``register_comm_hook``,
``save_state`` gathers every rank's optimizer state into that one file (as
``checkpoint_all_ranks=True`` does: for the moment of the save every rank holds every rank's
momentum in host memory) and each rank loads its own part; the bare hook's momentum, which
Accelerate does not save, goes to a file per rank (:data:`HOOK_STATE_FILE`) and comes back at
``load_state``.

Needs ``pip install 'signmuon[accelerate]'``.
"""

from __future__ import annotations

import os
from functools import partial

try:
    import accelerate
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "signmuon.integrations.accelerate needs Accelerate: pip install 'signmuon[accelerate]'"
    ) from error

import torch
from torch.nn.parallel import DistributedDataParallel

from signmuon.comm_hooks import SignVoteState, VoteHookState, sign_vote_hook
from signmuon.optim import SignVoteOptimizer
from signmuon.optim.checkpoint import gather_next_state_dict

__all__ = ["HOOK_STATE_FILE", "register_comm_hook"]

HOOK_STATE_FILE = "signmuon_hook_rank{rank:05d}.pt"
"""Each rank's state of the bare hook, in ``save_state``'s folder."""

_FIX = (
    "Under Accelerate, call signmuon.integrations.accelerate.register_comm_hook(accelerator, model, optimizer) "
    "on the objects accelerator.prepare returned, before the first batch."
)


def register_comm_hook(
    accelerator: accelerate.Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    comm_state: SignVoteState | None = None,
) -> VoteHookState | None:
    """Register the vote on the prepared ``model``; returns the hook state (its ``stats``).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the prepared model (``DistributedDataParallel`` when several processes run).
        optimizer: the prepared optimizer (an ``AcceleratedOptimizer`` is unwrapped). A
            ``SignMuon`` / ``SignumMV`` / ``SignSGDMV`` registers its own hook.
        comm_state: for any other optimizer, a ``SignVoteState``: the bare sign-vote hook, whose
            ±1 output that optimizer applies as is (so leave ``accelerator.clip_grad_norm_`` out:
            it would shrink the step; our optimizers take the sign and ignore clipping).

    On one process there is nothing to vote and None is returned (``SignMuon`` then does the
    whole step itself). A hook that has not run by the first optimizer step raises there.
    On several, ``accelerator.save_state`` / ``load_state`` then keep each rank's momentum (see
    the module's documentation).
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the user's
    voting = isinstance(inner, SignVoteOptimizer)
    if voting and comm_state is not None:
        raise ValueError(
            f"{type(inner).__name__} registers its own hook; comm_state is for other optimizers (pass one of the two)"
        )
    if not voting and comm_state is None:
        raise ValueError(
            f"{type(inner).__name__} does not vote: use SignMuon / SignumMV / SignSGDMV, or pass "
            "comm_state=SignVoteState(...) for the bare sign-vote hook"
        )
    if comm_state is not None and not isinstance(comm_state, SignVoteState):
        raise TypeError(f"comm_state must be a SignVoteState, got {type(comm_state).__name__}")
    if accelerator.num_processes == 1:
        return None
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"the model is a {type(model).__name__}, not DistributedDataParallel, on {accelerator.num_processes} "
            f"processes ({accelerator.distributed_type}): pass the model accelerator.prepare returned, and use "
            "Accelerate's multi-process (DDP) mode; DeepSpeed and FSDP plugins are not supported here"
        )
    if accelerator.scaler is not None and not voting:
        raise ValueError(
            "mixed_precision='fp16' with the bare sign-vote hook: GradScaler divides the voted ±1 gradient by its "
            "scale and so every step of a plain optimizer; use SignumMV / SignSGDMV / SignMuon, or bf16"
        )
    if voting:
        if accelerator.scaler is not None:  # fp16: the vote divides by the loss scale; overflows reach the scaler
            inner.use_grad_scaler(accelerator.scaler)
        # save_state asks every rank for the optimizer's state but writes the main process's alone.
        accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: gather_next_state_dict(inner))
        return inner.register_comm_hook(model)
    model.register_comm_hook(comm_state, sign_vote_hook)
    comm_state.check_called_by_first_step(inner, fix=_FIX)
    own = HOOK_STATE_FILE.format(rank=accelerator.process_index)
    accelerator.register_save_state_pre_hook(partial(_save_hook_state, comm_state, own))
    accelerator.register_load_state_pre_hook(partial(_load_hook_state, comm_state, own))
    return comm_state


def _save_hook_state(state: SignVoteState, name: str, models: list, weights: list, output_dir: str) -> None:
    torch.save(state.state_dict(), os.path.join(output_dir, name))


def _load_hook_state(state: SignVoteState, name: str, models: list, input_dir: str) -> None:
    path = os.path.join(input_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint holds no hook state of this rank (its momentum is its own); load a "
            "folder save_state wrote after register_comm_hook, on storage every rank sees"
        )
    state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
