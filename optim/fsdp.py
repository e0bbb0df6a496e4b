"""The sign-vote optimizers on a model sharded by FSDP2: shard inside the node, vote between nodes.

Usage (torchrun, N nodes of L ranks)::

    mesh = node_mesh()                                   # DeviceMesh (node, local) = (N, L)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["local"])           # shard over the node only
    fully_shard(model, mesh=mesh["local"])
    opt = SignMuon(model.parameters(), lr=2e-3)
    register_fsdp_vote(model, opt, mesh)

FSDP2's reduce-scatter gives each local rank its shard of the node's mean gradient in full
precision; as each unit's reduce-scatter ends, during backward, its all-reduce hook advances the
momentum on that shard (so optimizer state per rank is 1/L of DDP's) and votes its signs with the
ranks of the same local index on the other nodes, one bit per entry
(:class:`~signmuon.comm_hooks.shard_vote.ShardVoter`); ``opt.step()`` applies the vote. SignMuon's matrices
are gathered for Newton–Schulz at an owner inside the node. Do not pass a two-dimensional
(HSDP) mesh to ``fully_shard``: FSDP2 then all-reduces between nodes in full precision itself.

Checkpoints: ``torch.distributed.checkpoint`` through ``get_state_dict``/``set_state_dict``.
Each node's momentum is its own, so the optimizer's state dict holds it as a DTensor of shape
(N, *param.shape) on the (node, local) mesh; DCP writes every node's part. A checkpoint loads
on the same number of nodes with any number of ranks per node (DCP reshards the rows). On a
different number of nodes it cannot: :func:`check_checkpoint_layout`, called before
``dcp.load``, raises naming both layouts (``dcp.load`` alone fails on the momentum's size). A file per rank of ``opt.state_dict()`` also
loads, on the layout it was saved on; one rank's file loaded on every rank (a single
optimizer.pt saved on rank 0) is refused on every rank: the state dict carries a mark of which
rank saved which part, laid out as the momentum, which DCP reshards with it. A state dict saved
before the mark: each rank's own file loads as before, and a rank whose loaded momentum equals
another rank's (one file loaded on both) is refused on every rank, as every load is past 50
ranks per node (where some ranks hold none of the mark); a DCP checkpoint loads with
``dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))`` (plain ``dcp.load``
raises on every rank: ``Missing key ... signmuon.mark``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from signmuon.comm_hooks.dist import check_same_settings, group_device
from signmuon.comm_hooks.shard_vote import ShardVoter
from signmuon.comm_hooks.vote import NodeLayout

from .fsdp_exchange import ShardedExchange
from .fsdp_units import UnitVotes, fsdp_units
from .params import local_tensor
from .shards import shard_specs
from .sign_vote import SignVoteOptimizer

__all__ = ["ShardedExchange", "check_checkpoint_layout", "node_mesh", "register_fsdp_vote"]

MESH_DIMS = ("node", "local")


def node_mesh(ranks_per_node: int | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """The two-dimensional (node, local) ``DeviceMesh`` of N nodes of L ranks; a collective.

    ``ranks_per_node`` states L; None reads torchrun's ``LOCAL_WORLD_SIZE``. ``device_type``:
    None takes the default group's device (:func:`~signmuon.comm_hooks.dist.group_device`:
    ``"cuda"`` under NCCL, also as ``"cpu:gloo,cuda:nccl"``), else ``"cpu"``. Shard with
    ``fully_shard(module, mesh=mesh["local"])`` and pass the whole mesh to :func:`register_fsdp_vote`.
    """
    if not dist.is_initialized():
        raise RuntimeError("node_mesh() needs an initialised process group (torch.distributed.init_process_group)")
    if ranks_per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "node_mesh() needs the node size: run under torchrun (LOCAL_WORLD_SIZE) or pass ranks_per_node"
            )
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    world_size = dist.get_world_size()
    if (
        isinstance(ranks_per_node, bool)
        or not isinstance(ranks_per_node, int)
        or ranks_per_node < 1
        or world_size % ranks_per_node
    ):
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} must be an int >= 1 that divides the world size {world_size}"
        )
    if device_type is None:
        device_type = group_device(None).type
    return init_device_mesh(device_type, (world_size // ranks_per_node, ranks_per_node), mesh_dim_names=MESH_DIMS)


def _check_param(name: str, param: torch.Tensor, mesh: DeviceMesh) -> None:
    if not isinstance(param, DTensor):
        raise ValueError(
            f"parameter {name} is not sharded (a plain tensor): its gradient would not be averaged inside the node; "
            "apply fully_shard(module, mesh=mesh['local']) to the root module too, so every parameter is sharded"
        )
    if param.device_mesh.ndim != 1:
        raise ValueError(
            f"parameter {name} is sharded on a {param.device_mesh.ndim}-D mesh {param.device_mesh.mesh_dim_names}: with "
            "a two-dimensional (HSDP) mesh FSDP2 all-reduces gradients between nodes in full precision before any "
            "hook, which is what the vote replaces. Shard over the node only, fully_shard(module, mesh=mesh['local']), "
            "and pass the (node, local) mesh of node_mesh() to register_fsdp_vote"
        )
    local = mesh["local"]
    if param.device_mesh.mesh.tolist() != local.mesh.tolist():
        raise ValueError(
            f"parameter {name} is sharded over ranks {param.device_mesh.mesh.tolist()}, but this rank's node is "
            f"{local.mesh.tolist()} (mesh['local']): shard with fully_shard(module, mesh=mesh['local'])"
        )
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"parameter {name} has placements {param.placements}; the FSDP vote needs FSDP2's default Shard(0)"
        )


def register_fsdp_vote(
    model: torch.nn.Module, optimizer: SignVoteOptimizer, mesh: DeviceMesh, *, during_backward: bool = True
) -> ShardedExchange:
    """Make ``optimizer`` (SignMuon, SignumMV, SignSGDMV) vote between nodes the gradient shards
    FSDP2 leaves inside each node; returns what it registered (``optimizer.stats`` counts bytes).

    ``model`` is sharded with ``fully_shard(..., mesh=mesh["local"])`` (nested units per block
    as usual); ``mesh`` is the (node, local) mesh of :func:`node_mesh`. Every parameter of
    ``model`` that requires a gradient must be in ``optimizer`` and the other way round. Call
    it on every rank, before the first step.

    ``during_backward``: vote each unit in its all-reduce hook as backward reduces it, so the
    traffic between nodes runs while backward computes the next units (it replaces any
    all-reduce hook set before); ``step()`` applies what was voted. False: vote everything in
    ``step()``. The results are the same bit for bit. Every node must then reduce the same
    units in each backward, in the same order (as FSDP2 already needs inside a node); nodes
    that meet on different units of one size raise ``VoteMismatchError`` on every rank. Pass
    False where data-dependent control flow changes the order between nodes.

    Gradient accumulation: FSDP2's ``model.set_requires_gradient_sync(False)`` on all but the
    last micro-batch; the vote runs once per step, on the last. A second synchronised backward
    before ``step()`` raises.
    """
    name = type(optimizer).__name__
    if not isinstance(optimizer, SignVoteOptimizer):
        raise TypeError(f"register_fsdp_vote takes SignMuon, SignumMV or SignSGDMV, not {name}")
    if optimizer.vote_in_step or optimizer.has_comm_hook:
        raise ValueError(
            f"{name} already votes by vote_in_step or a DDP hook; create it without them for the FSDP vote"
        )
    if isinstance(optimizer.exchange, ShardedExchange):
        raise ValueError(f"register_fsdp_vote was already called for this {name}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        got = f"a {mesh.ndim}-D mesh {mesh.mesh_dim_names}" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(
            f"register_fsdp_vote needs the two-dimensional (node, local) mesh of node_mesh(), got {got}; shard the "
            "model over mesh['local'] and pass the whole mesh here"
        )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for n, p in named:
        _check_param(n, p, mesh)
    in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in named if p not in in_optimizer]
    if missing or len(in_optimizer) != len(named):
        raise ValueError(
            f"the optimizer and the model's trainable parameters differ (not in the optimizer: {missing[:5]}); "
            "every parameter needs its node's vote, so give the optimizer all of model.parameters(), and create "
            "it after fully_shard (which replaces the parameters with DTensors)"
        )
    nodes, per_node = mesh.shape
    ranks_per_node = optimizer.vote_config.ranks_per_node
    if ranks_per_node is not None and ranks_per_node != per_node:
        raise ValueError(f"VoteConfig(ranks_per_node={ranks_per_node}) but the mesh has {per_node} ranks per node")
    if not isinstance(during_backward, bool):
        raise TypeError(f"during_backward must be True or False, not {during_backward!r}")
    given = optimizer.process_group
    if given is not None and sorted(dist.get_process_group_ranks(given)) != sorted(mesh.mesh.flatten().tolist()):
        raise ValueError(  # the mesh says who votes; a group given as well would be silently ignored
            f"{name} was given process_group over ranks {dist.get_process_group_ranks(given)}, but the FSDP vote runs "
            f"over the mesh's ranks {mesh.mesh.tolist()} (nodes x local): create the optimizer without process_group "
            "and pass the mesh of the ranks that should vote to register_fsdp_vote"
        )
    node_group = mesh["local"].get_group()
    if during_backward:  # the worker thread's collectives must not interleave with FSDP2's on its group
        groups = [dist.new_group(ranks) for ranks in mesh.mesh.tolist()]
        node_group = groups[mesh.get_coordinate()[0]]
    layout = NodeLayout(dist.get_world_size(), dist.get_rank(), per_node, nodes, node_group, mesh["node"].get_group())
    specs = shard_specs(optimizer, per_node)
    for p, spec in specs.items():
        lo, hi = spec.rows(per_node, layout.local_rank)
        if p.dim() == 0 or local_tensor(p).shape[0] != hi - lo:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} is not split by rows as FSDP2 splits (rows {lo}..{hi} here)"
            )
    for p in in_optimizer:  # the optimizer works on this rank's shards from now on
        state = optimizer.state[p]
        for key, value in list(state.items()):
            if isinstance(value, DTensor):
                state[key] = value.to_local()
    units = fsdp_units(model) if during_backward else []
    placed = [p for _, params in units for p in params]
    if during_backward and (len(placed) != len(set(placed)) or set(placed) != in_optimizer):
        raise ValueError(
            "every trainable parameter must belong to exactly one fully_shard-ed module for the vote during "
            "backward (a parameter shared between units is not); pass during_backward=False"
        )
    check_same_settings(optimizer.settings(), optimizer.process_group, what=f"{name} settings")
    sharded = ShardedExchange(
        mesh, ShardVoter(layout, optimizer.vote_config, optimizer.stats, defer_mismatch=True), specs
    )
    optimizer.use_exchange(sharded)
    if during_backward:
        order = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        sharded.units = UnitVotes(
            [sorted(params, key=order.__getitem__) for _, params in units],
            per_node,
            lambda unit, params, grads: sharded.vote(optimizer, params, name, grads, unit),
            sharded.voter.device,
            settle=lambda: sharded.voter.settle(sharded.hint),
        )
        sharded.units.register([module for module, _ in units])
    return sharded


def check_checkpoint_layout(checkpoint_id: Any, optimizer: SignVoteOptimizer) -> tuple[int, int]:
    """The (nodes, ranks per node) a DCP checkpoint's momentum was saved on; ValueError naming
    both layouts if ``optimizer`` (after :func:`register_fsdp_vote`) cannot resume from it.

    ``checkpoint_id``: a checkpoint directory or a DCP ``StorageReader``. The rule: the same
    number of nodes, any number of ranks per node. Reads the metadata only; call it on every rank
    before ``dcp.load``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sharded = optimizer.exchange
    if not isinstance(sharded, ShardedExchange):
        raise ValueError("check_checkpoint_layout needs an optimizer registered with register_fsdp_vote")
    reader = FileSystemReader(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id
    saved = [
        md
        for key, md in reader.read_metadata().state_dict_metadata.items()
        if key.endswith(".momentum_buffer") and isinstance(md, TensorStorageMetadata)
    ]
    if not saved:
        raise ValueError(
            f"{checkpoint_id}: no per-node momentum in this checkpoint (was it saved after register_fsdp_vote?)"
        )
    nodes = saved[0].size[0]
    # Node 0's non-empty row shards: the ranks per node it was saved with.
    per_node = max(
        sum(1 for c in md.chunks if c.offsets[0] == 0 and (len(c.sizes) < 2 or c.sizes[1] > 0)) for md in saved
    )
    now_nodes, now_per_node = sharded.mesh_shape
    if nodes != now_nodes:
        raise ValueError(
            f"the checkpoint was saved on {nodes} node(s) x {per_node} rank(s); this run has {now_nodes} node(s) x "
            f"{now_per_node} rank(s). Each node's momentum is its own: resume on {nodes} node(s) (any ranks per node)"
        )
    return nodes, per_node
