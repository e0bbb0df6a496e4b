"""torchtitan 0.3.0: the optimizer container built from a torchtitan config on a tiny
two-block model sharded by FSDP2 over 2 nodes x 2 ranks equals our own API, bit for bit."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from signmuon.comm_hooks import VoteConfig
from signmuon.optim import SignMuon, node_mesh, register_fsdp_vote
from tests.harness import batch, capture, run_distributed

GROUP = {"lr": 0.01, "momentum": 0.9, "non_matrix": "adamw"}
VOTE = VoteConfig(tie="exact")


class Blocks(nn.Module):
    """A torchtitan-shaped model: blocks in a ModuleList, each its own FSDP unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 12), nn.Linear(12, 12)])
        self.output = nn.Linear(12, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.output(x)


def _sharded(mesh):
    model = Blocks()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["local"])
    fully_shard(model, mesh=mesh["local"])
    return model


def _train(model, optimizer, rank):
    for step in range(3):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.full_tensor().clone() for p in model.parameters()]


def _worker(rank, world_size):
    from torchtitan.components.optimizer import ParamGroupConfig

    from signmuon.integrations.torchtitan import SignVoteOptimizersContainer

    mesh = node_mesh(2)
    model = _sharded(mesh)
    config = SignVoteOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="SignMuon", optimizer_kwargs=GROUP)],
        optimizer_factory_kwargs_by_name={"SignMuon": {"vote": VOTE}},
    )
    container = config.build(model_parts=[model], mesh=mesh)
    kinds = [type(o).__name__ for o in container]
    ours = _train(model, container, rank)
    model = _sharded(mesh)
    opt = SignMuon(model.parameters(), **GROUP, vote=VOTE)
    register_fsdp_vote(model, opt, mesh)
    reference = _train(model, opt, rank)
    adamw = SignVoteOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]
    )
    fused = SignVoteOptimizersContainer.Config(param_groups=config.param_groups, implementation="fused")
    misplaced = SignVoteOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r".*", optimizer_name="SignMuon", optimizer_kwargs={**GROUP, "vote": VOTE})
        ]
    )
    errors = {
        "misplaced": capture(lambda: misplaced.build(model_parts=[_sharded(mesh)], mesh=mesh)),
        "adamw": capture(lambda: adamw.build(model_parts=[_sharded(mesh)], mesh=mesh)),
        "fused": capture(lambda: fused.build(model_parts=[_sharded(mesh)], mesh=mesh)),
    }
    return kinds, ours, reference, container.optimizers[0].stats.bytes_sent_between_nodes, errors


def test_the_container_from_a_torchtitan_config_votes_as_our_api():
    results = run_distributed(_worker, 4)
    for kinds, ours, reference, between, errors in results:
        assert kinds == ["SignMuon"]
        assert all(torch.equal(a, b) for a, b in zip(ours, reference))
        assert not torch.equal(ours[0], Blocks().layers[0].weight.detach())  # it trained
        assert between > 0  # the vote crossed nodes
        assert "would never cross nodes" in errors["adamw"] and "'AdamW'" in errors["adamw"]
        assert "for-loop" in errors["fused"]
        assert "optimizer_factory_kwargs_by_name" in errors["misplaced"] and "'vote'" in errors["misplaced"]
