"""The FSDP2 side of the cells: :class:`.ddp_world.Net` sharded inside nodes of 2 ranks
(``fully_shard`` per layer and at the root, over ``node_mesh(2)["local"]``), voted between
nodes by ``register_fsdp_vote``. Its reference is :func:`.ddp_world.simulate` with
``per_node=2``: the node means (missing ones as zeros, over 2), momentum, direction, the vote of
the nodes, which is the FSDP vote's definition as it is the node-aware DDP hook's."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from signmuon.comm_hooks import VoteConfig
from signmuon.optim import SignMuon, SignumMV, fsdp_exchange, node_mesh, register_fsdp_vote

from .ddp_world import BETA, LR, Config, Net, backward

PER_NODE = 2
ENTRIES = {"SignumMV": "SignumMV, FSDP2 vote", "SignMuon": "SignMuon, FSDP2 vote"}


def sharded(mesh, frozen: bool = False) -> Net:
    net = Net()
    if frozen:
        net.extra.requires_grad_(False)
    for layer in (net.body[0], net.body[2], net.extra):
        fully_shard(layer, mesh=mesh["local"])
    fully_shard(net, mesh=mesh["local"])
    return net


def optimizer(entry: str, params, **options):
    vote = options.pop("vote", VoteConfig(tie="exact"))
    kind = SignMuon if entry == "SignMuon" else SignumMV
    return kind(params, lr=LR, momentum=BETA, vote=vote, **options)


def whole(net: Net) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def run_steps(net, opt, config: Config, rank: int, start: int, stop: int, sync_all: bool = False) -> None:
    """``sync_all``: every micro-batch's backward reduces (no ``set_requires_gradient_sync(False)``)."""
    use_extra = rank not in config.unused_on
    for step in range(start, stop):
        opt.zero_grad()
        for micro in range(config.micro):
            net.set_requires_gradient_sync(sync_all or micro == config.micro - 1)
            backward(net, rank, step, micro, use_extra)
        opt.step()


def train(
    rank: int, world_size: int, config: Config, during_backward: bool = True, frozen: bool = False, sync_all=False
):
    """Train ``config`` (its ``steps`` the same on every rank) under the FSDP vote; the whole parameters."""
    torch.set_num_threads(1)
    mesh = node_mesh(PER_NODE)
    net = sharded(mesh, frozen)
    opt = optimizer(config.entry, [p for p in net.parameters() if p.requires_grad])
    register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    run_steps(net, opt, config, rank, 0, config.steps[rank], sync_all)
    return whole(net)


def _folder() -> str:
    made = [tempfile.mkdtemp(prefix="signmuon-fsdp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    return made[0]


def _dcp_save(net, opt, folder: str, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(net, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)


def _dcp_load(net, opt, folder: str, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _own_file_save(net, opt, folder: str, rank: int) -> None:
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, f"{folder}/rank{rank}.pt")


def _own_file_load(net, opt, folder: str, rank: int) -> None:
    own = torch.load(f"{folder}/rank{rank}.pt", weights_only=False)
    net.load_state_dict(own["model"])
    opt.load_state_dict(own["optim"])


def _rank0_optimizer_load(net, opt, folder: str, rank: int) -> None:
    """Each rank's own model, but rank 0's optimizer file on every rank (as a resume that saved
    one optimizer.pt on rank 0 reads it)."""
    net.load_state_dict(torch.load(f"{folder}/rank{rank}.pt", weights_only=False)["model"])
    opt.load_state_dict(torch.load(f"{folder}/rank0.pt", weights_only=False)["optim"])


def _rank0_optimizer_on_rank2(net, opt, folder: str, rank: int) -> None:
    """Rank 0's optimizer file on rank 2 (node 1's rank of the same rows: the same shapes), each
    other rank its own."""
    net.load_state_dict(torch.load(f"{folder}/rank{rank}.pt", weights_only=False)["model"])
    opt.load_state_dict(torch.load(f"{folder}/rank{0 if rank == 2 else rank}.pt", weights_only=False)["optim"])


def _unmarked(save):
    """``save`` of an optimizer state dict as saved before it carried the mark of who saved it."""

    def strip(net, opt, folder: str, rank: int) -> None:
        state_dict = opt.state_dict

        def without_mark():
            state = state_dict()
            for group in state["param_groups"]:
                group.get("signmuon", {}).pop("mark", None)
            return state

        opt.state_dict = without_mark
        try:
            save(net, opt, folder, rank)
        finally:
            del opt.state_dict

    return strip


def _dcp_partial_load(net, opt, folder: str, rank: int) -> None:
    """``dcp.load`` that leaves what the checkpoint lacks as the fresh objects have it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _one_mark_column(load):
    """``load`` where the mark has one column, so node 1's rank 3 holds none of it (as every
    rank past the 50th of a node holds none of the 2520 columns)."""

    def narrow(net, opt, folder: str, rank: int) -> None:
        columns = fsdp_exchange._MARK_COLUMNS
        fsdp_exchange._MARK_COLUMNS = 1
        try:
            load(net, opt, folder, rank)
        finally:
            fsdp_exchange._MARK_COLUMNS = columns

    return narrow


def _rank1_optimizer_on_rank3(net, opt, folder: str, rank: int) -> None:
    """Rank 1's optimizer file on rank 3 (node 1's rank of the same rows), each other rank its own."""
    net.load_state_dict(torch.load(f"{folder}/rank{rank}.pt", weights_only=False)["model"])
    opt.load_state_dict(torch.load(f"{folder}/rank{1 if rank == 3 else rank}.pt", weights_only=False)["optim"])


SAVES = {
    "dcp": (_dcp_save, _dcp_load),
    "torch.save": (_own_file_save, _own_file_load),
    "rank 0's file": (_own_file_save, _rank0_optimizer_load),
    "dcp, no mark": (_unmarked(_dcp_save), _dcp_load),
    "dcp, no mark, partial load": (_unmarked(_dcp_save), _dcp_partial_load),
    "torch.save, no mark": (_unmarked(_own_file_save), _own_file_load),
    "rank 0's file, no mark": (_unmarked(_own_file_save), _rank0_optimizer_load),
    "rank 0's file on rank 2, no mark": (_unmarked(_own_file_save), _rank0_optimizer_on_rank2),
    "rank 1's file on rank 3, one mark column": (
        _one_mark_column(_own_file_save),
        _one_mark_column(_rank1_optimizer_on_rank3),
    ),
}
"""How a checkpoint is written and read: DCP (``get_state_dict``/``set_state_dict``), each
rank's model and optimizer ``state_dict()`` in a file of its own, or rank 0's optimizer file
loaded on every rank (refused); "no mark": the optimizer's ``state_dict()`` as saved before it
carried the mark of who saved it."""


def resumed(rank: int, world_size: int, config: Config, at: int = 2, via: str = "dcp"):
    """``at`` steps, a checkpoint of model and optimizer written as ``via`` says (:data:`SAVES`),
    a fresh model and optimizer that load it, then the rest of ``config.steps``."""
    save, load = SAVES[via]
    torch.set_num_threads(1)
    folder = _folder()
    try:
        mesh = node_mesh(PER_NODE)
        net = sharded(mesh)
        opt = optimizer(config.entry, net.parameters())
        register_fsdp_vote(net, opt, mesh)
        run_steps(net, opt, config, rank, 0, at)
        save(net, opt, folder, rank)
        dist.barrier()
        torch.manual_seed(100 + rank)
        net = sharded(mesh)
        with torch.no_grad():  # another start: everything must come from the checkpoint
            for p in net.parameters():
                p.add_(1.0)
        opt = optimizer(config.entry, net.parameters())
        register_fsdp_vote(net, opt, mesh)
        load(net, opt, folder, rank)
        run_steps(net, opt, config, rank, at, config.steps[rank])
        return whole(net)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def given_group(rank: int, world_size: int, entry: str):
    """An optimizer given its node's group (as if to vote there) and then the FSDP vote between nodes."""
    mesh = node_mesh(PER_NODE)
    net = sharded(mesh)
    opt = optimizer(entry, net.parameters(), process_group=mesh["local"].get_group())
    register_fsdp_vote(net, opt, mesh)
    run_steps(net, opt, Config(entry, (1,) * world_size), rank, 0, 1)
    return whole(net)


def other_node_size(rank: int, world_size: int, entry: str):
    mesh = node_mesh(PER_NODE)
    net = sharded(mesh)
    opt = optimizer(entry, net.parameters(), vote=VoteConfig(tie="exact", hierarchical=True, ranks_per_node=4))
    register_fsdp_vote(net, opt, mesh)


def second_backward(rank: int, world_size: int, entry: str, during_backward: bool):
    mesh = node_mesh(PER_NODE)
    net = sharded(mesh)
    opt = optimizer(entry, net.parameters())
    register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    backward(net, rank, 0, 0, True)
    backward(net, rank, 0, 1, True)  # accumulation without set_requires_gradient_sync(False)
    opt.step()
    return whole(net)


def a_step_ahead(rank: int, world_size: int, entry: str, during_backward: bool):
    """Rank 3 (node 1) a step ahead of the others, as after a resume from another step's files."""
    mesh = node_mesh(PER_NODE)
    net = sharded(mesh)
    opt = optimizer(entry, net.parameters())
    register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    if rank == 3:
        opt.steps_taken = 1
    run_steps(net, opt, Config(entry, (1,) * world_size), rank, 0, 1)
    return whole(net)
