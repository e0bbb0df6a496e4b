"""DeepSpeed ZeRO-1/2 with the vote between nodes (DeepSpeed on CPU, gloo): equal to node-aware
DDP and to a single-process node-level reference, every rank skipping together, checkpoints,
refusals. Few spawns: each process group runs many checks."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import VoteConfig
from signmuon.comm_hooks.vote import vote_bytes_per_rank
from signmuon.integrations.deepspeed import initialize
from signmuon.optim import SignumMV
from tests.harness import run_distributed

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions")
)

L = 2  # ranks per node
LR, BETA, WD = 0.01, 0.9, 0.01
STEPS = 3


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # 212 entries: partitions cut w1 mid-row


def _micro_batch(rank, step, micro):
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def _params(name):
    return {"lr": LR, "weight_decay": WD} | ({"momentum": BETA} if name == "SignumMV" else {})


def _config(stage, gas, name="SignumMV", clip=0.0, **extra):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": name, "params": _params(name)},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "vote": {"ranks_per_node": L, "tie": "exact"},  # the DDP hook's coins are drawn per tensor
        **extra,
    }


def _train(engine, model, rank, steps, gas, start=0, bad_step=None):
    history = []
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = _micro_batch(rank, step, micro)
            loss = nn.functional.cross_entropy(engine(x), y)
            if step == bad_step and rank == 0:
                # one rank of node 0, one tensor: only local rank 1's partition holds the NaN
                loss = loss + float("nan") * model[2].bias.sum()
            engine.backward(loss)
            engine.step()
        history.append([p.detach().clone().float() for p in model.parameters()])
    return history


def _zero_run(rank, stage, gas, name="SignumMV", clip=0.0):
    model = _model(seed=rank)  # every rank its own init: the broadcast must give all rank 0's
    engine, _, _, _ = initialize(model=model, config=_config(stage, gas, name, clip))
    return _train(engine, model, rank, STEPS, gas)


def _ddp_run(rank, gas):
    net = _model()
    opt = SignumMV(
        net.parameters(),
        lr=LR,
        momentum=BETA,
        weight_decay=WD,
        vote=VoteConfig(hierarchical=True, ranks_per_node=L, tie="exact"),
    )
    model = DDP(net)
    opt.register_comm_hook(model)
    history = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(gas):
            x, y = _micro_batch(rank, step, micro)
            if micro < gas - 1:
                with model.no_sync():
                    (nn.functional.cross_entropy(model(x), y) / gas).backward()
            else:
                (nn.functional.cross_entropy(model(x), y) / gas).backward()
        opt.step()
        history.append([p.detach().clone() for p in net.parameters()])
    return history


def node_reference(world_size, gas, beta=BETA, clip=0.0, steps=STEPS, ranks_per_node=L):
    """One process: each node votes the sign of its momentum of its mean gradient (clipped at the
    node's norm), the N nodes' signs are majority-voted, decoupled weight decay, then the step."""
    model = _model()
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
                    x, y = _micro_batch(rank, step, micro)
                    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y) / gas, params)
                    total = [t + g for t, g in zip(total, grads)]
            mean = [t / ranks_per_node for t in total]
            if clip:
                norm = torch.sqrt(sum((g.double() ** 2).sum() for g in mean)).float()
                mean = [g / torch.clamp((norm + 1e-6) / clip, min=1.0) for g in mean]
            for m, g, s in zip(momenta[node], mean, signs):
                direction = m.lerp_(g, 1 - beta) if beta else g
                s.add_(direction.sign())
        with torch.no_grad():
            for p, s in zip(params, signs):
                p.mul_(1 - LR * WD).add_(s.sign(), alpha=-LR)
        history.append([p.detach().clone() for p in params])
    return history


CELLS = [(1, 1, "SignumMV"), (2, 2, "SignumMV"), (1, 2, "SignumMV"), (2, 1, "SignSGDMV")]


def _cells(rank, world_size, cells, ddp_gas, clip_cell):
    out = {("zero",) + cell: _zero_run(rank, *cell) for cell in cells}
    out.update({("ddp", gas): _ddp_run(rank, gas) for gas in ddp_gas})
    if clip_cell:
        out[("clip",)] = _zero_run(rank, 2, 2, clip=0.05)
    return out


def _check(results, world_size, cells, ddp_gas, clip_cell):
    for stage, gas, name in cells:
        beta = BETA if name == "SignumMV" else 0.0
        reference = node_reference(world_size, gas, beta)
        for rank, result in enumerate(results):
            for step in range(STEPS):
                for a, b in zip(result[("zero", stage, gas, name)][step], reference[step]):
                    assert torch.equal(a, b), f"ZeRO-{stage} {name} gas {gas}: rank {rank} step {step}"
                if name == "SignumMV" and gas in ddp_gas:
                    for a, b in zip(result[("zero", stage, gas, name)][step], result[("ddp", gas)][step]):
                        assert torch.equal(a, b), f"ZeRO-{stage} vs node-aware DDP: rank {rank} step {step}"
    if clip_cell:
        reference = node_reference(world_size, 2, BETA, clip=0.05)
        unclipped = node_reference(world_size, 2, BETA)
        assert any(not torch.equal(a, b) for a, b in zip(reference[-1], unclipped[-1])), "clipping changed nothing"
        for rank, result in enumerate(results):
            for a, b in zip(result[("clip",)][-1], reference[-1]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"clipped: rank {rank}")


@pytest.mark.parametrize("world_size", [4, 6], ids=["2x2", "3x2"])
def test_zero_signum_equals_node_aware_ddp_and_node_reference(world_size):
    """Stages 1 and 2, accumulation 1 and 2, SignumMV and SignSGDMV: every rank's weights after
    every step equal the node-level reference and node-aware DDP bit for bit."""
    cells = CELLS if world_size == 4 else CELLS[:2]
    ddp_gas = (1, 2) if world_size == 4 else (2,)
    clip_cell = world_size == 4
    results = run_distributed(_cells, world_size, cells, ddp_gas, clip_cell, timeout=900)
    _check(results, world_size, cells, ddp_gas, clip_cell)


def _robustness(rank, world_size, folder, docs_config):
    out = {}
    # docs/frameworks.md's ZeRO-2 config as it stands, the node size from LOCAL_WORLD_SIZE (as torchrun sets it).
    os.environ["LOCAL_WORLD_SIZE"] = str(L)
    model = _model()
    docs_config = {k: v for k, v in docs_config.items() if k != "vote"}  # its L is 8
    engine, zero_opt, _, _ = initialize(model=model, config=docs_config)
    out["docs_config"] = _train_bf16(engine, model, rank)
    (partition,) = zero_opt.optimizer.param_groups[0]["params"]
    momentum = zero_opt.optimizer.state[partition]["momentum_buffer"]
    out["state"] = (momentum.numel(), momentum.dtype, partition.numel())
    out["bytes_per_step"] = zero_opt.optimizer.stats.bytes_sent / STEPS
    del os.environ["LOCAL_WORLD_SIZE"]
    # A NaN on one rank of node 0: every rank skips that step (nothing moves), none hangs.
    model = _model()
    engine, zero_opt, _, _ = initialize(model=model, config=_config(2, 1))
    out["nan_skip"] = _train(engine, model, rank, STEPS, 1, bad_step=1)
    out["skipped"] = zero_opt.optimizer.stats.skipped
    model = _model()
    config = _config(1, 1)
    config["vote"]["nonfinite"] = "raise"
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        _train(engine, model, rank, STEPS, 1, bad_step=0)
        out["nan_raise"] = None
    except Exception as error:  # noqa: BLE001 - the test asserts the type below
        out["nan_raise"] = type(error).__name__
    # Save after 2 steps, train on; a fresh engine (other initial weights) resumes bit-identically.
    for stage in (1, 2):
        model = _model()
        engine, _, _, _ = initialize(model=model, config=_config(stage, 2))
        _train(engine, model, rank, 2, 2)
        engine.save_checkpoint(folder, tag=f"s{stage}")
        out[("full", stage)] = _train(engine, model, rank, 2, 2, start=2)
        model = _model(seed=100 + rank)
        engine, _, _, _ = initialize(model=model, config=_config(stage, 2))
        engine.load_checkpoint(folder, tag=f"s{stage}")
        out[("resumed", stage)] = _train(engine, model, rank, 2, 2, start=2)
    out["files"] = sorted(os.listdir(os.path.join(folder, "s2")))
    # Another ranks-per-node: refused on every rank, by name.
    model = _model()
    config = _config(2, 2)
    config["vote"]["ranks_per_node"] = 1
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        engine.load_checkpoint(folder, tag="s2")
        out["other_layout"] = None
    except ValueError as error:
        out["other_layout"] = str(error)
    # bf16: DeepSpeed's bf16 parameters, float32 partitions voted; every node the same model.
    model = _model()
    engine, _, _, _ = initialize(model=model, config=_config(2, 1, bf16={"enabled": True}))
    out["bf16"] = _train_bf16(engine, model, rank)
    return out


def _train_bf16(engine, model, rank):
    for step in range(STEPS):
        x, y = _micro_batch(rank, step, 0)
        engine.backward(nn.functional.cross_entropy(engine(x.bfloat16()), y))
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def test_zero_nan_checkpoint_layout_and_bf16(tmp_path):
    world_size = 4
    docs = (Path(__file__).parent.parent / "docs" / "frameworks.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", docs, flags=re.S)
    docs_config = next(json.loads(b) for b in blocks if '"stage": 2' in b)
    results = run_distributed(_robustness, world_size, str(tmp_path), docs_config, timeout=900)
    assert all(torch.equal(a, b) for r in results for a, b in zip(r["docs_config"], results[0]["docs_config"]))
    for rank, result in enumerate(results):
        history = result["nan_skip"]
        assert all(torch.equal(a, b) for a, b in zip(history[0], history[1])), f"rank {rank} moved on a NaN step"
        assert not all(torch.equal(a, b) for a, b in zip(history[1], history[2])), f"rank {rank} stopped training"
        assert result["skipped"] == 1
        assert result["nan_raise"] == "NonFiniteError", f"rank {rank}: {result['nan_raise']}"
        for stage in (1, 2):
            for full, resumed in zip(result[("full", stage)], result[("resumed", stage)]):
                for a, b in zip(full, resumed):
                    assert torch.equal(a, b), f"ZeRO-{stage} resume differs on rank {rank}"
        assert result["other_layout"] is not None and "ranks per node" in result["other_layout"], result["other_layout"]
        assert all(torch.equal(a, b) for a, b in zip(result["bf16"], results[0]["bf16"])), "bf16 nodes diverged"
    total = sum(p.numel() for p in _model().parameters())
    for result in results:  # the node's momentum, 1/L per rank; between nodes, the rail vote's bytes
        numel, dtype, partition = result["state"]
        assert numel == partition and dtype == torch.float32 and numel <= -(-total // L) + 8
        nodes = world_size // L
        agreement = (nodes - 1) * 2 * 8  # step() agrees the step and who has a gradient: 2 int64 words
        assert result["bytes_per_step"] == vote_bytes_per_rank(partition, nodes, agree_sizes=False) + agreement
    assert [f"signmuon_optimizer_rank{r:05d}.pt" in results[0]["files"] for r in range(4)] == [True] * 4
    for a, b in zip(results[0]["nan_skip"][-1], results[3]["nan_skip"][-1]):
        assert torch.equal(a, b)
    initial = list(_model().parameters())
    assert not all(torch.equal(a.float(), b) for a, b in zip(results[0]["bf16"], initial))


@pytest.mark.parametrize(
    "change, words",
    [
        ({"zero_optimization": {"stage": 3}}, "stage 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "ZeRO++"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"sequence_parallel_size": 2}, "sequence parallel"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor parallelism"),
        ({"optimizer": {"type": "SignMuon", "params": {"lr": 0.01}}}, "Newton–Schulz"),
        ({"vote": {"hierarchical": False}}, "always votes between nodes"),
    ],
    ids=["zero3", "offload", "zeropp", "fp16", "sequence", "tensor", "signmuon", "flat-vote"],
)
def test_zero_refusals_say_what_to_do(change, words):
    """Decided from the config alone, before any collective: the same on every rank."""
    with pytest.raises(ValueError, match=words):
        initialize(model=_model(), config=_config(2, 1) | change)


def test_zero_refuses_a_users_mpu():
    with pytest.raises(ValueError, match="mpu"):
        initialize(model=_model(), config=_config(1, 1), mpu=object())


def test_zero_refuses_several_param_groups():
    model = _model()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="one parameter group"):
        initialize(model=model, config=_config(2, 1), model_parameters=groups)
