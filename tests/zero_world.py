"""The world of the DeepSpeed ZeRO tests (tests/test_deepspeed_zero.py, tests/conformance/test_zero_cells.py):
the model, the data, the config, a ZeRO run, the node-aware DDP and FSDP2 runs it must equal, and the
single-process node-level reference both must equal (nodes simulated in a loop, no process group)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import VoteConfig
from signmuon.optim import SignMuon, SignumMV, node_mesh, register_fsdp_vote
from signmuon.optim.newton_schulz import as_matrix, newton_schulz

L = 2  # ranks per node
LR, BETA, WD = 0.01, 0.9, 0.01
STEPS = 3


def zero_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # 212 entries: partitions cut w1 mid-row


def micro_batch(rank, step, micro):
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def optimizer_params(name):
    return {"lr": LR, "weight_decay": WD} | ({"momentum": BETA} if name in ("SignumMV", "SignMuon") else {})


def ds_config(stage, gas, name="SignumMV", clip=0.0, options=None, **extra):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": name, "params": optimizer_params(name) | (options or {})},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "vote": {"ranks_per_node": L, "tie": "exact"},  # the DDP hook's coins are drawn per tensor
        **extra,
    }


def train_engine(engine, model, rank, steps, gas, start=0, bad_step=None):
    """Train ``steps`` steps of ``gas`` micro-batches; every parameter (float32) after each step."""
    history = []
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = micro_batch(rank, step, micro)
            loss = nn.functional.cross_entropy(engine(x), y)
            if step == bad_step and rank == 0:
                # one rank of node 0, one tensor: only local rank 1's partition holds the NaN
                loss = loss + float("nan") * model[2].bias.sum()
            engine.backward(loss)
            engine.step()
        history.append([p.detach().clone().float() for p in model.parameters()])
    return history


def ddp_run(rank, gas, name="SignumMV", **options):
    """The node-aware DDP hook on the same data (SignumMV or SignMuon, with ``options``): every
    parameter after each step."""
    net = zero_model()
    vote = VoteConfig(hierarchical=True, ranks_per_node=L, tie="exact")
    cls = SignMuon if name == "SignMuon" else SignumMV
    opt = cls(net.parameters(), lr=LR, momentum=BETA, weight_decay=WD, vote=vote, **options)
    model = DDP(net)
    opt.register_comm_hook(model)
    history = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(gas):
            x, y = micro_batch(rank, step, micro)
            if micro < gas - 1:
                with model.no_sync():
                    (nn.functional.cross_entropy(model(x), y) / gas).backward()
            else:
                (nn.functional.cross_entropy(model(x), y) / gas).backward()
        opt.step()
        history.append([p.detach().clone() for p in net.parameters()])
    return history


def fsdp_run(rank, gas, name="SignumMV"):
    """FSDP2 inside each node (per-layer units), the vote between nodes during backward, on the
    same data: every whole parameter after each step."""
    mesh = node_mesh(L)
    net = zero_model()
    for unit in (net[0], net[2], net):
        fully_shard(unit, mesh=mesh["local"])
    cls = SignMuon if name == "SignMuon" else SignumMV
    opt = cls(net.parameters(), lr=LR, momentum=BETA, weight_decay=WD, vote=VoteConfig(tie="exact"))
    register_fsdp_vote(net, opt, mesh)
    history = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(gas):
            net.set_requires_gradient_sync(micro == gas - 1)
            x, y = micro_batch(rank, step, micro)
            (nn.functional.cross_entropy(net(x), y) / gas).backward()
        opt.step()
        history.append([p.full_tensor().detach().clone() for p in net.parameters()])
    return history


def node_reference(world_size, gas, beta=BETA, clip=0.0, steps=STEPS, ranks_per_node=L, muon=False):
    """One process: each node's mean gradient (clipped at the node's norm), its momentum, its
    direction (SignMuon: the Nesterov look-ahead, Newton–Schulz on matrices) and that direction's
    sign; the N nodes' signs majority-voted, decoupled weight decay, then the step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same float results
    try:
        return _node_reference(world_size, gas, beta, clip, steps, ranks_per_node, muon)
    finally:
        torch.set_num_threads(threads)


def _node_reference(world_size, gas, beta, clip, steps, ranks_per_node, muon):
    model = zero_model()
    params = list(model.parameters())
    nodes = world_size // ranks_per_node
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(nodes)]
    history = []
    for step in range(steps):
        signs = [torch.zeros_like(p) for p in params]
        for node in range(nodes):
            total = [torch.zeros_like(p) for p in params]
            for rank in range(node * ranks_per_node, (node + 1) * ranks_per_node):
                for micro in range(gas):
                    x, y = micro_batch(rank, step, micro)
                    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y) / gas, params)
                    total = [t + g for t, g in zip(total, grads)]
            mean = [t / ranks_per_node for t in total]
            if clip:
                norm = torch.sqrt(sum((g.double() ** 2).sum() for g in mean)).float()
                mean = [g / torch.clamp((norm + 1e-6) / clip, min=1.0) for g in mean]
            for m, g, s in zip(momenta[node], mean, signs):
                direction = m.lerp_(g, 1 - beta) if beta else g
                if muon:
                    direction = g.lerp(m, beta)
                    if direction.dim() >= 2:
                        direction = newton_schulz(as_matrix(direction), 5).view_as(direction)
                s.add_(direction.sign())
        with torch.no_grad():
            for p, s in zip(params, signs):
                p.mul_(1 - LR * WD).add_(s.sign(), alpha=-LR)
        history.append([p.detach().clone() for p in params])
    return history
