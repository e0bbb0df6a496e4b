"""bf16 parameters under the DDP hook: the vote runs on bf16 gradients, momentum and
Newton-Schulz in float32, updates on float32 master weights; equal to a float32 reference
computed from the same bf16 gradients."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import VoteConfig
from signmuon.optim import SignMuon
from tests.harness import batch, node_reference_step, run_distributed, tiny_net

LR, BETA, STEPS = 0.01, 0.9, 3


def _worker(rank, world_size, master_weights):
    net = tiny_net().to(torch.bfloat16)
    opt = SignMuon(net.parameters(), lr=LR, momentum=BETA, vote=VoteConfig(tie="exact"), master_weights=master_weights)
    model = DDP(net)
    opt.register_comm_hook(model)
    weights = lambda: [opt.update_target(p).detach().float().clone() for p in net.parameters()]  # noqa: E731
    trajectory = [weights()]
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
        opt.step()
        trajectory.append(weights())
    dtypes = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k == "momentum_buffer"}
    return trajectory, dtypes, [p.dtype for p in net.parameters()]


def test_bf16_parameters_vote_bf16_gradients_with_float32_momentum_and_master_weights():
    results = run_distributed(_worker, 2, True)
    trajectory, dtypes, param_dtypes = results[0]
    assert dtypes == {"torch.float32"} and set(param_dtypes) == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(trajectory[-1], results[1][0][-1])), "replicas differ"
    momenta = [[torch.zeros_like(p) for p in trajectory[0]] for _ in range(2)]
    for step in range(STEPS):  # each rank is its own "node": the flat vote of two workers
        expected = node_reference_step(
            "signmuon", trajectory[step], step, 2, 1, momenta, LR, BETA, dtype=torch.bfloat16
        )
        for a, b in zip(trajectory[step + 1], expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"step {step}")
    # The master weights keep what bf16 cannot hold; without them the parameters are the bf16 sums.
    assert any(not torch.equal(w, w.bfloat16().float()) for w in trajectory[-1])
    plain = run_distributed(_worker, 2, False)[0][0]
    assert all(torch.equal(w, w.bfloat16().float()) for w in plain[-1])
