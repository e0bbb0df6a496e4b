"""DeepSpeed ZeRO-1/2 with the vote between nodes (DeepSpeed on CPU, gloo): equal to node-aware
DDP, to FSDP2's node-aware vote and to a single-process node-level reference (tests/zero_world.py), every rank skipping
together, checkpoints, refusals; SignumMV and SignSGDMV bit for bit, SignMuon (Newton–Schulz at
each matrix's owner) to float tolerance. Few spawns: each process group runs many checks."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from signmuon.comm_hooks.vote import vote_bytes_per_rank
from signmuon.integrations.deepspeed import initialize
from tests.harness import run_distributed
from tests.zero_world import (
    BETA,
    STEPS,
    L,
    ddp_run,
    ds_config,
    fsdp_run,
    micro_batch,
    node_reference,
    train_engine,
    zero_model,
)

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions")
)

MUON_ATOL = 1e-6  # Newton–Schulz in other processes: the same float32 math, maybe not the same last bits


def _zero_run(rank, stage, gas, name="SignumMV", clip=0.0, options=None):
    model = zero_model(seed=rank)  # every rank its own init: the broadcast must give all rank 0's
    engine, _, _, _ = initialize(model=model, config=ds_config(stage, gas, name, clip, options))
    return train_engine(engine, model, rank, STEPS, gas)


CELLS = [
    (1, 1, "SignumMV"),
    (2, 2, "SignumMV"),
    (1, 2, "SignumMV"),
    (2, 1, "SignSGDMV"),
    (1, 1, "SignMuon"),
    (2, 2, "SignMuon"),
]
MUON_OPTIONS = {"non_matrix": "adamw", "polar_after_vote": True}  # held to node-aware DDP (the reference has neither)


def _cells(rank, world_size, cells, ddp_runs, extras):
    out = {("zero",) + cell: _zero_run(rank, *cell) for cell in cells}
    out.update({("ddp", gas, name): ddp_run(rank, gas, name) for gas, name in ddp_runs})
    out.update({("fsdp", gas, name): fsdp_run(rank, gas, name) for gas, name in ddp_runs})
    if extras:
        out[("clip",)] = _zero_run(rank, 2, 2, clip=0.05)
        out[("options", "zero")] = _zero_run(rank, 2, 1, "SignMuon", options=MUON_OPTIONS)
        out[("options", "ddp")] = ddp_run(rank, 1, "SignMuon", **MUON_OPTIONS)
    return out


def _same(a, b, name):
    """SignumMV and SignSGDMV bit for bit; SignMuon to float tolerance."""
    return torch.allclose(a, b, rtol=0, atol=MUON_ATOL) if name == "SignMuon" else torch.equal(a, b)


def _check(results, world_size, cells, ddp_runs, extras):
    for stage, gas, name in cells:
        reference = node_reference(world_size, gas, 0.0 if name == "SignSGDMV" else BETA, muon=name == "SignMuon")
        for rank, result in enumerate(results):
            for step in range(STEPS):
                for a, b in zip(result[("zero", stage, gas, name)][step], reference[step]):
                    assert _same(a, b, name), f"ZeRO-{stage} {name} gas {gas}: rank {rank} step {step}"
                if (gas, name) in ddp_runs:
                    for a, b in zip(result[("zero", stage, gas, name)][step], result[("ddp", gas, name)][step]):
                        assert _same(a, b, name), f"ZeRO-{stage} {name} vs node-aware DDP: rank {rank} step {step}"
                    for a, b in zip(result[("zero", stage, gas, name)][step], result[("fsdp", gas, name)][step]):
                        assert _same(a, b, name), f"ZeRO-{stage} {name} vs FSDP2's vote: rank {rank} step {step}"
    muon, signum = node_reference(world_size, 1, muon=True), node_reference(world_size, 1)
    assert any(not torch.equal(a, b) for a, b in zip(muon[-1], signum[-1])), "Newton–Schulz changed no sign"
    if extras:
        reference = node_reference(world_size, 2, BETA, clip=0.05)
        unclipped = node_reference(world_size, 2, BETA)
        assert any(not torch.equal(a, b) for a, b in zip(reference[-1], unclipped[-1])), "clipping changed nothing"
        for rank, result in enumerate(results):
            for a, b in zip(result[("clip",)][-1], reference[-1]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"clipped: rank {rank}")
            for step, (zero, ddp) in enumerate(zip(result[("options", "zero")], result[("options", "ddp")])):
                assert all(_same(a, b, "SignMuon") for a, b in zip(zero, ddp)), (
                    f"{MUON_OPTIONS}: rank {rank} step {step}"
                )
        plain = results[0][("zero", 1, 1, "SignMuon")][0]
        assert any(not torch.equal(a, b) for a, b in zip(results[0][("options", "zero")][0], plain)), MUON_OPTIONS


@pytest.mark.parametrize("world_size", [4, 6], ids=["2x2", "3x2"])
def test_zero_equals_node_aware_ddp_and_node_reference(world_size):
    """Stages 1 and 2, accumulation 1 and 2, SignumMV and SignSGDMV (bit for bit), SignMuon (to
    float tolerance, also with AdamW off the matrices and the polar step after the vote): every
    rank's weights after every step equal the node-level reference, node-aware DDP and FSDP2's
    node-aware vote (built in the same process group, per-layer units)."""
    cells = CELLS if world_size == 4 else [CELLS[0], CELLS[1], CELLS[5]]
    gases = (1, 2) if world_size == 4 else (2,)
    ddp_runs = [(gas, name) for gas in gases for name in ("SignumMV", "SignMuon")]
    extras = world_size == 4
    results = run_distributed(_cells, world_size, cells, ddp_runs, extras, timeout=900)
    _check(results, world_size, cells, ddp_runs, extras)


def _nan_run(rank, name):
    model = zero_model()
    engine, zero_opt, _, _ = initialize(model=model, config=ds_config(2, 1, name))
    return train_engine(engine, model, rank, STEPS, 1, bad_step=1), zero_opt.optimizer.stats.skipped


def _resume_run(rank, folder, stage, name="SignumMV"):
    """Save after 2 steps, train on; a fresh engine (other initial weights) loads and trains the same 2."""
    model = zero_model()
    engine, _, _, _ = initialize(model=model, config=ds_config(stage, 2, name))
    train_engine(engine, model, rank, 2, 2)
    engine.save_checkpoint(folder, tag=f"{name}{stage}")
    full = train_engine(engine, model, rank, 2, 2, start=2)
    model = zero_model(seed=100 + rank)
    engine, _, _, _ = initialize(model=model, config=ds_config(stage, 2, name))
    engine.load_checkpoint(folder, tag=f"{name}{stage}")
    return full, train_engine(engine, model, rank, 2, 2, start=2)


def _step_reads(rank, name):
    """Host reads by our code in each ``engine.step()`` (torch kernels: the CPU ones read their own buffers)."""
    from tests.gpu_world import counting_host_reads

    model = zero_model()
    config = ds_config(2, 1, name)
    config["vote"]["kernels"] = "torch"
    engine, _, _, _ = initialize(model=model, config=config)
    per_step = []
    for step in range(3):
        x, y = micro_batch(rank, step, 0)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        with counting_host_reads() as reads:
            engine.step()
        per_step.append((reads.total, dict(reads.sites)))
    return per_step


def _state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def _robustness(rank, world_size, folder, docs_config):
    out = {}
    # docs/frameworks.md's ZeRO-2 config as it stands, the node size from LOCAL_WORLD_SIZE (as torchrun sets it).
    os.environ["LOCAL_WORLD_SIZE"] = str(L)
    model = zero_model()
    docs_config = {k: v for k, v in docs_config.items() if k != "vote"}  # its L is 8
    engine, zero_opt, _, _ = initialize(model=model, config=docs_config)
    out["docs_config"] = _train_bf16(engine, model, rank)
    (partition,) = zero_opt.optimizer.param_groups[0]["params"]
    momentum = zero_opt.optimizer.state[partition]["momentum_buffer"]
    out["state"] = (momentum.numel(), momentum.dtype, partition.numel())
    out["bytes_per_step"] = zero_opt.optimizer.stats.bytes_sent / STEPS
    del os.environ["LOCAL_WORLD_SIZE"]
    # A NaN on one rank of node 0: every rank skips that step (nothing moves), none hangs.
    for name in ("SignumMV", "SignMuon"):
        out[("nan_skip", name)], out[("skipped", name)] = _nan_run(rank, name)
    model = zero_model()
    config = ds_config(1, 1)
    config["vote"]["nonfinite"] = "raise"
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        train_engine(engine, model, rank, STEPS, 1, bad_step=0)
        out["nan_raise"] = None
    except Exception as error:  # noqa: BLE001 - the test asserts the type below
        out["nan_raise"] = type(error).__name__
    for stage, name in ((1, "SignumMV"), (2, "SignumMV"), (2, "SignMuon")):
        out[("full", stage, name)], out[("resumed", stage, name)] = _resume_run(rank, folder, stage, name)
    out["files"] = sorted(os.listdir(os.path.join(folder, "SignumMV2")))
    # Another ranks-per-node: refused on every rank, by name.
    model = zero_model()
    config = ds_config(2, 2)
    config["vote"]["ranks_per_node"] = 1
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        engine.load_checkpoint(folder, tag="SignumMV2")
        out["other_layout"] = None
    except ValueError as error:
        out["other_layout"] = str(error)
    # bf16: DeepSpeed's bf16 parameters, float32 partitions voted; every node the same model.
    for name in ("SignumMV", "SignMuon"):
        model = zero_model()
        engine, zero_opt, _, _ = initialize(model=model, config=ds_config(2, 1, name, bf16={"enabled": True}))
        out[("bf16", name)] = _train_bf16(engine, model, rank)
    out["muon_state_bytes"] = _state_bytes(zero_opt.optimizer.optimizer)  # SignMuon's, on the model's parameters
    for name in ("SignumMV", "SignMuon"):
        out[("reads", name)] = _step_reads(rank, name)
    return out


def _train_bf16(engine, model, rank):
    for step in range(STEPS):
        x, y = micro_batch(rank, step, 0)
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
        for name in ("SignumMV", "SignMuon"):
            history = result[("nan_skip", name)]
            assert all(torch.equal(a, b) for a, b in zip(history[0], history[1])), f"{name}: rank {rank} moved on NaN"
            assert not all(torch.equal(a, b) for a, b in zip(history[1], history[2])), f"{name}: rank {rank} stopped"
            assert result[("skipped", name)] == 1
            assert all(torch.equal(a, b) for a, b in zip(history[-1], results[0][("nan_skip", name)][-1]))
            bf16 = result[("bf16", name)]
            assert all(torch.equal(a, b) for a, b in zip(bf16, results[0][("bf16", name)])), (
                f"bf16 {name}: nodes diverged"
            )
            assert not all(torch.equal(a.float(), b) for a, b in zip(bf16, zero_model().parameters())), name
        assert result["nan_raise"] == "NonFiniteError", f"rank {rank}: {result['nan_raise']}"
        for stage, name in ((1, "SignumMV"), (2, "SignumMV"), (2, "SignMuon")):
            for full, resumed in zip(result[("full", stage, name)], result[("resumed", stage, name)]):
                for a, b in zip(full, resumed):
                    assert torch.equal(a, b), f"ZeRO-{stage} {name} resume differs on rank {rank}"
        assert result["other_layout"] is not None and "ranks per node" in result["other_layout"], result["other_layout"]
    total = sum(p.numel() for p in zero_model().parameters())
    for result in results:  # the node's momentum, 1/L per rank; between nodes, the rail vote's bytes
        numel, dtype, partition = result["state"]
        assert numel == partition and dtype == torch.float32 and numel <= -(-total // L) + 8
        nodes = world_size // L
        agreement = (nodes - 1) * 2 * 8  # step() agrees the step and who has a gradient: 2 int64 words
        assert result["bytes_per_step"] == vote_bytes_per_rank(partition, nodes, agree_sizes=False) + agreement
        assert result["muon_state_bytes"] <= (1 / L + 0.05) * 4 * total, (result["muon_state_bytes"], total)
    assert sum(r["muon_state_bytes"] for r in results[:L]) == 4 * total  # the node's momentum, once, in fp32
    assert [f"signmuon_optimizer_rank{r:05d}.pt" in results[0]["files"] for r in range(4)] == [True] * 4
    for result in results:  # per step: the overflow check's one read, which also agrees on the step and
        # settles the voter's deferred mismatches (they read no word of their own), and three of the vote's
        for name in ("SignumMV", "SignMuon"):
            reads = result[("reads", name)]
            assert [total for total, _ in reads[1:]] == [4, 4], (name, reads)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"zero_optimization": {"stage": 3}}, "stage 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "ZeRO++"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"sequence_parallel_size": 2}, "sequence parallel"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor parallelism"),
        ({"vote": {"hierarchical": False}}, "always votes between nodes"),
    ],
    ids=["zero3", "offload", "zeropp", "fp16", "sequence", "tensor", "flat-vote"],
)
def test_zero_refusals_say_what_to_do(change, words):
    """Decided from the config alone, before any collective: the same on every rank."""
    with pytest.raises(ValueError, match=words):
        initialize(model=zero_model(), config=ds_config(2, 1) | change)


def test_zero_refuses_a_users_mpu():
    with pytest.raises(ValueError, match="mpu"):
        initialize(model=zero_model(), config=ds_config(1, 1), mpu=object())


def test_zero_refuses_several_param_groups():
    model = zero_model()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="one parameter group"):
        initialize(model=model, config=ds_config(2, 1), model_parameters=groups)
