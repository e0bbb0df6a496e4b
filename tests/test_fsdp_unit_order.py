"""The FSDP vote during backward takes units in the order they close. Where nodes close them in
different orders (data-dependent control flow), every rank raises instead of voting one unit's
gradients against another's of the same size; ``during_backward=False`` is the remedy."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from signmuon.optim import SignMuon, SignumMV, node_mesh, register_fsdp_vote
from tests.harness import capture, run_distributed

PER_NODE = 2


class _Branches(nn.Module):
    """Two units of one shape, run in the opposite order on the second node."""

    def __init__(self, unit: type[nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.first, self.second = unit(8), unit(8)

    def forward(self, x: torch.Tensor, swap: bool, skip: bool = False) -> torch.Tensor:
        a, b = (self.second, self.first) if swap else (self.first, self.second)
        x = self.lin(x)
        return (b(x) if skip else b(a(x))).square().mean()


def _square(width: int) -> nn.Module:
    return nn.Linear(width, width)


def _worker(rank, world_size):
    mesh = node_mesh(PER_NODE)
    swap = rank // PER_NODE == 1
    out = {}
    cases = {
        "voted": (_square, lambda params: SignumMV(params, lr=0.01, momentum=0.9), True),
        # Vectors on AdamW: these units' exchange is the mean alone, an all-reduce without a header.
        "mean_only": (nn.LayerNorm, lambda params: SignMuon(params, lr=0.01, non_matrix="adamw"), True),
        # The second node leaves a unit out: no backward reduces it there, so step() votes it.
        "skipped": (_square, lambda params: SignumMV(params, lr=0.01, momentum=0.9), True),
        "in_step": (_square, lambda params: SignumMV(params, lr=0.01, momentum=0.9), False),
    }
    for name, (unit, make, during_backward) in cases.items():
        torch.manual_seed(0)
        net = _Branches(unit)
        for module in (net.first, net.second, net):
            fully_shard(module, mesh=mesh["local"])
        opt = make(net.parameters())
        register_fsdp_vote(net, opt, mesh, during_backward=during_backward)

        def train():
            for step in range(2):
                opt.zero_grad()
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
                (net(x, False, skip=swap) if name == "skipped" else net(x, swap)).backward()
                opt.step()

        out[name] = capture(train)
        if name == "in_step":
            out["params"] = [p.full_tensor() for p in net.parameters()]
    return out


def test_units_closing_in_another_order_on_one_node_raise_on_every_rank():
    results = run_distributed(_worker, 2 * PER_NODE)
    for rank, got in enumerate(results):
        for case in ("voted", "mean_only", "skipped"):
            error = got[case]
            assert error is not None and error.startswith("VoteMismatchError"), (rank, case, error)
            assert "FSDP units in the order" in error and "during_backward=False" in error, (rank, case, error)
        assert got["in_step"] is None, (rank, got["in_step"])
    # The remedy votes in step(), where the order is the optimizer's: the replicas stay equal.
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], other["params"]))
