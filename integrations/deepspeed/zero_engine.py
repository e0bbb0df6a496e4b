"""``initialize`` for ZeRO-1/2 configs: the engine on the node partitions, our optimizer on them,
and checkpoints that keep every rank's momentum partition (the design: :mod:`.zero`)."""

from __future__ import annotations

import functools
import inspect
import os
import pickle

import torch
import torch.distributed as dist

from signmuon.comm_hooks import VoteConfig
from signmuon.comm_hooks.dist import barrier, gather_rows
from signmuon.comm_hooks.shard_vote import ShardVoter
from signmuon.optim import sign_optimizer_from_spec

from .checkpoints import RANK_STATE_FILE, read_rank_file
from .zero import (
    NodePartitionMPU,
    ZeroLayout,
    agree_step,
    broadcast_model,
    check_zero_config,
    defer_mismatch,
    refuse_model,
    zero_layout,
)
from .zero_muon import sign_muon_on_partitions

__all__ = ["initialize_zero"]

WHOLE_TENSOR_OPTIMIZERS = ("signmuon",)  # Newton–Schulz needs whole matrices: built on the parameters (.zero_muon)


def initialize_zero(deepspeed, *, model, config: dict, name: str, reserved, kwargs: dict, model_parameters=None):
    """``deepspeed.initialize`` with ZeRO inside each node and the vote between nodes; DeepSpeed's
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The config's ``"vote"`` section
    takes ``ranks_per_node`` (L; else ``LOCAL_WORLD_SIZE``) and the fields of the rail's vote."""
    section = dict(config.get("vote", {}))
    ranks_per_node = section.pop("ranks_per_node", None)
    if section.pop("hierarchical", True) is not True:
        raise ValueError(
            'ZeRO with our optimizers always votes between nodes (ZeRO reduces inside each node): drop "hierarchical" '
            'from the "vote" section, or use "zero_optimization": {"stage": 0} for a flat vote'
        )
    vote = VoteConfig.from_dict(section)
    check_zero_config(config, name, kwargs)
    refuse_model(model, name)
    spec = {"type": name, "params": config["optimizer"].get("params", {})}
    options = dict(reserved=reserved, vote=vote, vote_in_step=True, checkpoint_all_ranks=False)
    defaults = sign_optimizer_from_spec(spec, [torch.zeros(1)], **options).defaults  # bad params: refused now
    given = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    given = [g for g in given]
    if not all(isinstance(g, dict) for g in given):
        given = [{"params": given}]
    if len(given) != 1:
        # DeepSpeed steps the base optimizer once per group, showing it that group alone.
        raise ValueError(
            f"optimizer {name} with ZeRO takes one parameter group, not {len(given)}: pass the parameters as "
            "one group (per-group settings under ZeRO are not supported yet), or use ZeRO stage 0"
        )
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=kwargs.get("dist_backend"))
    layout = zero_layout(ranks_per_node)
    broadcast_model(model)
    # A stateless stand-in for DeepSpeed to partition (ours would hold a whole model's momentum meanwhile).
    placeholder = torch.optim.SGD([dict(g) for g in given], lr=defaults["lr"])
    # Ours is not one of the optimizers ZeRO knows by name; its step is the partition's step.
    rest = {k: v for k, v in config.items() if k not in ("optimizer", "vote")} | {"zero_allow_untested_optimizer": True}
    engine, zero_optimizer, loader, scheduler = deepspeed.initialize(
        model=model, config=rest, optimizer=placeholder, mpu=NodePartitionMPU(layout), **kwargs
    )
    # ZeRO has replaced each group's parameters with this rank's flat fp32 partition: the
    # optimizer that steps them is built on those (its state keyed by the partitions), or, for
    # SignMuon, on the model's parameters with its state on their pieces of the partition.
    # The group keeps what its caller set and the lr DeepSpeed's scheduler may have set since.
    (group,) = placeholder.param_groups
    groups = [{k: group[k] for k in {"params", "lr", *given[0]}}]
    if name.lower() in WHOLE_TENSOR_OPTIMIZERS:
        settings = {k: v for k, v in groups[0].items() if k != "params"}
        opt, base = sign_muon_on_partitions(zero_optimizer, spec, settings, layout, vote, reserved)
        voter = opt.exchange.voter  # its exchange's: the rail idle after a mismatch, all-to-alls going on
    else:
        opt = base = sign_optimizer_from_spec(spec, groups, **options, process_group=layout.rail_group)
        # the same rule for the step's own vote (L == 1: the rail is every rank, it raises everywhere now)
        voter = ShardVoter(layout.node_layout(), vote, opt.stats, defer_mismatch=layout.ranks_per_node > 1)
        defer_mismatch(base, voter)
    zero_optimizer.optimizer = base
    if getattr(scheduler, "optimizer", None) is placeholder:
        scheduler.optimizer = base
    agree_step(zero_optimizer, opt, voter, vote)
    if dist.get_rank() >= layout.ranks_per_node:  # DeepSpeed's files: node 0 writes them, the others would clash
        engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
    checkpoint_zero_per_rank(engine, opt, layout)
    return engine, zero_optimizer, loader, scheduler


def _layout_of(layout: ZeroLayout) -> dict[str, int]:
    return {"nodes": layout.nodes, "ranks_per_node": layout.ranks_per_node}


def checkpoint_zero_per_rank(engine, opt, layout: ZeroLayout) -> None:
    """``save_checkpoint`` also writes this rank's optimizer state (its node's momentum on its
    partition) to its own file; ``load_checkpoint`` reads it back, after every rank agrees that
    every rank's file is there, readable and of this layout (else every rank raises, naming it)."""
    save, load = engine.save_checkpoint, engine.load_checkpoint
    save_signature, load_signature = inspect.signature(save), inspect.signature(load)

    def rank_file(folder: str) -> str:
        return os.path.join(folder, RANK_STATE_FILE.format(rank=dist.get_rank()))

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        bound = save_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["tag"] is None:
            bound.arguments["tag"] = f"global_step{engine.global_steps}"
        result = save(*bound.args, **bound.kwargs)
        folder = os.path.join(bound.arguments["save_dir"], str(bound.arguments["tag"]))
        os.makedirs(folder, exist_ok=True)
        torch.save({**opt.state_dict(), "zero_layout": _layout_of(layout)}, rank_file(folder))
        barrier()
        return result

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        bound = load_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        with_optimizer = bound.arguments["load_optimizer_states"] and not bound.arguments["load_module_only"]
        bound.arguments["load_optimizer_states"] = False  # DeepSpeed's hold node 0's momentum only
        path, client_state = load(*bound.args, **bound.kwargs)
        if with_optimizer:
            saved, refusal = _read_own(path, rank_file, layout)
            # every rank decides on every rank's answer: all load, or all raise
            refused = gather_rows(torch.tensor([refusal is not None]), None).reshape(-1).tolist()
            if any(refused):
                ranks = [rank for rank, bad in enumerate(refused) if bad]
                raise ValueError(f"not resuming on any rank: ranks {ranks} cannot load; here: {refusal or 'loadable'}")
            opt.load_state_dict(saved)
        return path, client_state

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def _read_own(path, rank_file, layout: ZeroLayout) -> tuple[dict | None, str | None]:
    """This rank's saved state and None, or None and why it cannot be loaded."""
    if path is None:
        return None, "DeepSpeed found no checkpoint to load"
    own = rank_file(os.path.dirname(path))
    if not os.path.exists(own):
        return None, f"{own} is missing (each rank writes its own: saved by every rank, on storage every rank sees?)"
    try:
        saved = read_rank_file(own)
    except pickle.UnpicklingError as error:
        return None, str(error)
    found = saved.pop("zero_layout", None)
    if found != _layout_of(layout):
        return None, (
            f"the checkpoint was written by {found} (nodes x ranks per node), this run is {_layout_of(layout)}: "
            "each node's momentum is partitioned over its ranks, so resume on the same nodes and ranks per node"
        )
    return saved, None
