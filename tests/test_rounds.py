"""Rounds with an outer step (DiLoCo, DPPF around the consensus), one-bit rounds and node-aware
rounds, on real gloo processes against single-process references (DiLoCo against torchft's:
tests/test_streaming_rounds.py)."""

import functools
import math
import os
import tempfile

import pytest
import torch
from torch import nn

from signmuon.comm_hooks import VoteConfig, node_layout
from signmuon.optim import LocalStepAverager, OuterStep, local_sgd
from tests.harness import (
    capture,
    compressed_allreduce_reference,
    flat_params,
    rounds_batch,
    rounds_inner,
    rounds_loss,
    rounds_model,
    run_distributed,
    sign_vote_combine,
)

H = 3  # local steps per round
STEPS = 7


# --- the single-process reference: DiLoCo (and DPPF around its consensus) as published ----------


def _reference(
    workers,
    steps,
    period,
    outer_lr=0.7,
    momentum=0.9,
    pull=1.0,
    push=0.0,
    combine="mean",
    block=0,
    scale_bits=32,
    tie="exact",
):
    """Each worker's flat parameters after every step (``block``: entries per scale of the vote)."""
    models = [rounds_model() for _ in range(workers)]
    inners = [rounds_inner(m) for m in models]
    consensus = flat_params(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=outer_lr, momentum=momentum, nesterov=True)
    sizes = [p.numel() for p in models[0].parameters()]
    if block:  # each tensor's runs of `block` entries scale on their own
        sizes = [min(block, size - at) for size in sizes for at in range(0, size, block)]
    errors = None
    history = []
    for step in range(steps):
        for w, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            rounds_loss(m, rounds_batch(w, step)).backward()
            opt.step()
        if (step + 1) % period == 0:
            coins = (step + 1) // period - 1 if tie == "fast" else None
            deltas = [consensus - flat_params(m) for m in models]
            if combine == "mean":
                consensus.grad = sum(deltas) / workers
            elif combine == "sign_vote":
                consensus.grad = sign_vote_combine(deltas, sizes, scale_bits, coins)
            elif combine == "sign_vote_ef":
                errors = errors or [torch.zeros_like(consensus) for _ in range(workers)]
                fed = [d + e for d, e in zip(deltas, errors)]
                for w, c in enumerate(fed):  # each worker keeps what its own scaled signs leave out
                    pieces = c.split(sizes)
                    errors[w] = torch.cat([p - p.sign() * p.abs().mean() for p in pieces])
                consensus.grad = sign_vote_combine(fed, sizes, scale_bits, coins)
            else:
                n = consensus.numel()
                padded = -(-n // (8 * workers)) * 8 * workers
                if errors is None:
                    errors = (
                        [torch.zeros(padded) for _ in range(workers)],
                        [torch.zeros(padded // workers) for _ in range(workers)],
                    )
                consensus.grad, *errors = compressed_allreduce_reference(deltas, *errors)
            outer.step()
            for m in models:
                x = flat_params(m)
                d = x - consensus
                new = x - pull * d + push * d / max(float(d.norm()), 1e-8)
                torch.nn.utils.vector_to_parameters(new, m.parameters())
        history.append([flat_params(m) for m in models])
    return history


def _rounds_worker(rank, world_size, pull, push, combine, steps, grouped=False, block=0, scale_bits=32, tie="exact"):
    model = rounds_model()
    params = list(model.parameters())  # grouped: out of module order, as Muon's groups are
    given = [{"params": params[::2]}, {"params": params[1::2][::-1]}] if grouped else params
    inner = rounds_inner(model)
    outer = OuterStep(
        optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        pseudo_gradient=combine,
        vote=VoteConfig(tie=tie),
        scale_block=block,
        scale_bits=scale_bits,
    )
    averager = LocalStepAverager(period=H, pull=pull, push=push, outer=outer, module=model)
    history = []
    for step in range(steps):
        inner.zero_grad()
        rounds_loss(model, rounds_batch(rank, step)).backward()
        inner.step()
        averager.average_parameters(given)
        history.append(flat_params(model).clone())
    consensus = _flat_of(averager.consensus_state_dict(model), model)
    return history, averager.rounds, averager.stats.bytes_sent, consensus


def _flat_of(state, model):
    names = [name for name, _ in model.named_parameters()]
    return torch.cat([state[n].reshape(-1) for n in names])


@pytest.mark.parametrize("pull, push", [(1.0, 0.0), (0.6, 0.02)])
def test_outer_step_rounds_equal_the_reference(pull, push):
    """pull=1, push=0 is DiLoCo; otherwise DPPF's pull and push act around the new consensus."""
    workers = 3
    results = run_distributed(_rounds_worker, workers, pull, push, "mean", STEPS)
    expected = _reference(workers, STEPS, H, pull=pull, push=push)
    for rank, (history, rounds, _, consensus) in enumerate(results):
        assert rounds == STEPS // H
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
    if pull == 1.0:  # right after the last round (after step 5 of 0..6) every worker is the consensus
        assert torch.equal(results[0][0][5], results[1][0][5])
        for history, _, _, consensus in results:  # and the model to evaluate is that consensus
            assert torch.equal(consensus, history[5])


def test_the_parameters_may_come_in_another_order_and_grouping():
    # MuLoCo: Muon's parameter groups list the matrices first; the consensus keeps the module's order.
    results = run_distributed(_rounds_worker, 2, 1.0, 0.0, "mean", STEPS, True)
    expected = _reference(2, STEPS, H)
    for rank, (history, rounds, _, _) in enumerate(results):
        assert rounds == STEPS // H
        torch.testing.assert_close(history[-1], expected[-1][rank], rtol=1e-5, atol=1e-6)


# 16-bit scales on 2 workers: a bfloat16 sum of two is the same in either order, so it is exact.
@pytest.mark.parametrize(
    "combine, block, scale_bits, workers",
    [
        ("sign_vote", 0, 32, 3),
        ("sign_vote_ef", 0, 32, 3),
        ("scaled_sign", 0, 32, 3),
        ("sign_vote_ef", 5, 32, 3),
        ("sign_vote_ef", 5, 16, 2),
        ("sign_vote_ef", 5, 8, 3),
        ("sign_vote", 0, 8, 2),
    ],
)
def test_one_bit_rounds_equal_the_reference(combine, block, scale_bits, workers):
    results = run_distributed(_rounds_worker, workers, 1.0, 0.0, combine, STEPS, False, block, scale_bits)
    expected = _reference(workers, STEPS, H, combine=combine, block=block, scale_bits=scale_bits)
    for rank, (history, _, _, _) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")


@pytest.mark.parametrize("combine, block, workers", [("sign_vote", 0, 2), ("sign_vote", 0, 4), ("sign_vote_ef", 5, 4)])
def test_one_bit_rounds_with_fast_ties_equal_the_reference(combine, block, workers):
    """tie="fast": where the workers split evenly the round's coin decides, the same on every rank
    (two-phase on 4 workers: each votes its shard with the coins of the whole)."""
    results = run_distributed(_rounds_worker, workers, 1.0, 0.0, combine, STEPS, False, block, 32, "fast")
    expected = _reference(workers, STEPS, H, combine=combine, block=block, tie="fast")
    exact = _reference(workers, STEPS, H, combine=combine, block=block)
    assert not torch.equal(expected[-1][0], exact[-1][0]), "ties occur, and the coins move the consensus"
    for rank, (history, _, _, _) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")


def _bytes_worker(rank, world_size, cases):
    return {case: _round_bytes(rank, *case) for case in cases}


def _round_bytes(rank, combine, tie, block=0, scale_bits=32):
    torch.manual_seed(0)
    model = nn.Linear(512, 512)
    outer = OuterStep(
        optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        pseudo_gradient=combine,
        vote=VoteConfig(tie=tie),
        scale_block=block,
        scale_bits=scale_bits,
    )
    averager = LocalStepAverager(period=1, outer=outer, module=model, track_distances=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
    averager.average_parameters(model.parameters())
    before = averager.stats.bytes_sent
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank + 10)))
    averager.average_parameters(model.parameters())  # a second round: without the first round's checks
    return averager.stats.bytes_sent - before


COMBINES = ("mean", "sign_vote", "sign_vote_ef", "scaled_sign")
BLOCK_CASES = [("sign_vote_ef", "exact", 64, bits) for bits in (32, 16, 8)]
BYTE_CASES = {
    4: [(c, "fast") for c in COMBINES] + [("sign_vote", "exact")],
    2: [(c, "exact") for c in COMBINES] + BLOCK_CASES,
}


@functools.cache
def _bytes_on(workers):
    """Rank 0's bytes of a second round, per (combine, tie): one set of processes per world size."""
    return run_distributed(_bytes_worker, workers, BYTE_CASES[workers])[0]


@pytest.mark.parametrize("workers, tie", [(4, "fast"), (2, "exact")])
def test_one_bit_rounds_send_a_32nd_of_the_fp32_round(workers, tie):
    fp32, *one_bits = (_bytes_on(workers)[(c, tie)] for c in COMBINES)
    assert fp32 >= 2 * (workers - 1) / workers * (512 * 513) * 4  # the ring's bytes of the fp32 pseudo-gradient
    for one_bit in one_bits:
        assert fp32 / 40 < one_bit < fp32 / 25, (fp32, one_bit)


def test_block_scales_cost_their_bits_per_block():
    got = _bytes_on(2)
    per_tensor, fp32, bf16, log8 = got[("sign_vote_ef", "exact")], *(got[case] for case in BLOCK_CASES)
    blocks = (
        512 * 512 // 64 + 512 // 64
    )  # the weight's and the bias's runs of 64; 2 ranks: the ring sends each byte once
    assert fp32 - per_tensor == (blocks - 2) * 4
    assert fp32 - bf16 == blocks * 2
    assert log8 - per_tensor == blocks + 4 - 2 * 4  # a byte per block and the largest scale, to the other rank


def test_exact_ties_among_more_than_two_workers_cost_at_most_a_second_bit():
    fp32, exact = _bytes_on(4)[("mean", "fast")], _bytes_on(4)[("sign_vote", "exact")]  # the fp32 round has no ties
    assert fp32 / 40 < exact < fp32 / 12, (fp32, exact)


# --- checkpoints --------------------------------------------------------------------------------


def _resume_worker(rank, world_size, combine, path):
    """Run STEPS steps straight, and again with a save after step 4 and a load into fresh objects."""

    def build():
        model = rounds_model()
        averager = LocalStepAverager(
            period=H, pull=0.7, push=0.01, outer=OuterStep.diloco(pseudo_gradient=combine), module=model
        )
        return model, rounds_inner(model), averager

    def run(model, inner, averager, steps):
        for step in steps:
            inner.zero_grad()
            rounds_loss(model, rounds_batch(rank, step)).backward()
            inner.step()
            averager.average_parameters(model.parameters())

    straight = build()
    run(*straight, range(STEPS + 3))
    first = build()
    run(*first, range(5))
    torch.save(
        {"model": first[0].state_dict(), "inner": first[1].state_dict(), "averager": first[2].state_dict()},
        f"{path}.{rank}",
    )
    resumed = build()
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    resumed[0].load_state_dict(saved["model"])
    resumed[1].load_state_dict(saved["inner"])
    resumed[2].load_state_dict(saved["averager"])
    run(*resumed, range(5, STEPS + 3))
    return (
        flat_params(straight[0]),
        flat_params(resumed[0]),
        straight[2].consensus.state_dict(),
        resumed[2].consensus.state_dict(),
    )


@pytest.mark.parametrize("combine", ["mean", "sign_vote_ef", "scaled_sign"])
def test_resume_is_bit_identical(combine):
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_resume_worker, 2, combine, os.path.join(tmp, "ckpt"))
    for straight, resumed, consensus_a, consensus_b in results:
        assert torch.equal(straight, resumed)
        assert all(torch.equal(a, b) for a, b in zip(consensus_a["tensors"], consensus_b["tensors"]))
        momentum = [s["momentum_buffer"] for s in consensus_a["optimizer"]["state"].values()]
        assert momentum and all(
            torch.equal(a["momentum_buffer"], b["momentum_buffer"])
            for a, b in zip(consensus_a["optimizer"]["state"].values(), consensus_b["optimizer"]["state"].values())
        )
        if combine != "mean":
            assert consensus_a["errors"] and any(bool(e.any()) for buffers in consensus_a["errors"] for e in buffers)
            assert all(
                torch.equal(a, b)
                for pa, pb in zip(consensus_a["errors"], consensus_b["errors"])
                for a, b in zip(pa, pb)
            )


# --- node-aware rounds ------------------------------------------------------------------------


def _node_worker(rank, world_size, combine, block=0, scale_bits=32, tie="exact"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    layout = node_layout(None, 2)
    model = DDP(rounds_model())
    outer = OuterStep.diloco(pseudo_gradient=combine)
    if combine != "mean":  # the ties the reference votes
        outer = OuterStep(
            optimizer=outer.optimizer, pseudo_gradient=combine, vote=VoteConfig(tie=tie), scale_block=block,
            scale_bits=scale_bits,
        )  # fmt: skip
    averager = LocalStepAverager(period=H, pull=1.0, outer=outer, module=model.module, layout=layout)
    opt = local_sgd(model, rounds_inner(model), averager)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        rounds_loss(model, rounds_batch(rank, step)).backward()
        opt.step()
        history.append(flat_params(model.module).clone())
    return history, averager.stats.bytes_sent_between_nodes, averager.consensus.tensors[0].numel()


def _blocks(sizes, lo, hi, block):
    """Lengths of the scale blocks of the slice [lo, hi) of tensors of ``sizes``, one by one."""
    found, start = [], 0
    for size in sizes:
        step = block or size
        for at in range(start, start + size, max(step, 1)):
            a, b = max(at, lo), min(at + step, start + size, hi)
            if b > a:
                found.append(b - a)
        start += size
    return found


def _rail_parts(shapes, per_node):
    """Node-aware rounds: local rank l carries entries [l·c, (l+1)·c) of the flat parameters
    (c = ceil(n / L)); its blocks are cut by the slice's edges, counted from each tensor's start."""
    sizes = [math.prod(shape) for shape in shapes]
    n = sum(sizes)
    chunk = -(-n // per_node)
    parts = []
    for local in range(per_node):
        lo, hi = local * chunk, min(n, (local + 1) * chunk)
        parts.append((torch.arange(lo, hi), lambda block, lo=lo, hi=hi: _blocks(sizes, lo, hi, block)))
    return parts


def _fsdp_parts(shapes, per_node):
    """FSDP2 rounds: local rank l carries rows [l·c, (l+1)·c) of each tensor (torch.chunk's split),
    its shards one after another; its blocks are counted from each shard's start."""
    offsets = [0]
    for shape in shapes:
        offsets.append(offsets[-1] + math.prod(shape))
    parts = []
    for local in range(per_node):
        index, shard_sizes = [], []
        for offset, shape in zip(offsets, shapes):
            rows, row = shape[0], math.prod(shape[1:])
            c = -(-rows // per_node)
            lo, hi = min(rows, local * c), min(rows, (local + 1) * c)
            index.append(torch.arange(offset + lo * row, offset + hi * row))
            shard_sizes.append((hi - lo) * row)
        parts.append((torch.cat(index), lambda block, s=shard_sizes: _blocks(s, 0, sum(s), block)))
    return parts


def _node_combine(deltas, errors, combine, parts, block, scale_bits, coins=None, scaled=None):
    """The nodes' pseudo-gradients combined as the rounds do when each local rank carries a part
    of the parameters (``parts``: its entries and its blocks): each part on its own, with its own
    scales, coins (``coins``: the round, for fast ties; entries counted from the part's start) and
    error feedback (``scaled``: each part's worker and server buffers of ``"scaled_sign"``)."""
    if combine == "mean":
        return sum(deltas) / len(deltas)
    grad = torch.zeros_like(deltas[0])
    for part, (index, blocks_of) in enumerate(parts):
        blocks = blocks_of(block)
        pieces = [d[index] for d in deltas]
        if combine == "scaled_sign":
            nodes, n = len(pieces), index.numel()
            padded = -(-n // (8 * nodes)) * 8 * nodes
            if part not in scaled:
                scaled[part] = ([torch.zeros(padded) for _ in pieces], [torch.zeros(padded // nodes) for _ in pieces])
            grad[index], *scaled[part] = compressed_allreduce_reference(pieces, *scaled[part])
            continue
        if combine == "sign_vote_ef":
            pieces = [p + e[index] for p, e in zip(pieces, errors)]
            for e, p in zip(errors, pieces):  # each node keeps what its own scaled signs leave out
                e[index] = torch.cat([q - q.sign() * q.abs().mean() for q in p.split(blocks)])
        grad[index] = sign_vote_combine(pieces, blocks, scale_bits, coins)
    return grad


def _node_reference(nodes, per_node, steps, combine="mean", block=0, scale_bits=32, partition=_rail_parts, tie="exact"):
    """DiLoCo over `nodes` workers whose gradient is the mean of their ranks' gradients; one-bit
    rules combine each local rank's part of the parameters (``partition``) on its own."""
    models = [rounds_model() for _ in range(nodes)]
    inners = [rounds_inner(m) for m in models]
    consensus = flat_params(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=0.7, momentum=0.9, nesterov=True)
    parts = partition([tuple(p.shape) for p in models[0].parameters()], per_node)
    errors = [torch.zeros_like(consensus) for _ in range(nodes)]
    scaled = {}
    history = []
    for step in range(steps):
        for node, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            sum(rounds_loss(m, rounds_batch(node * per_node + i, step)) for i in range(per_node)).div(
                per_node
            ).backward()
            opt.step()
        if (step + 1) % H == 0:
            deltas = [consensus - flat_params(m) for m in models]
            coins = (step + 1) // H - 1 if tie == "fast" else None
            consensus.grad = _node_combine(deltas, errors, combine, parts, block, scale_bits, coins, scaled)
            outer.step()
            for m in models:
                torch.nn.utils.vector_to_parameters(consensus.clone(), m.parameters())
        history.append([flat_params(m) for m in models])
    return history


def test_node_aware_rounds_equal_the_node_level_reference():
    results = run_distributed(_node_worker, 4, "mean")  # 2 nodes x 2 ranks
    expected = _node_reference(2, 2, STEPS)
    numel = expected[0][0].numel()
    for rank, (history, between, slice_numel) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(
                got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}"
            )
        chunk = math.ceil(numel / 2)
        assert slice_numel == min(chunk, numel - (rank % 2) * chunk)  # the consensus and its momentum: 1/L per rank
        # Between nodes: each round's ring over the 2 nodes' rail carries this rank's half.
        rail_ring = 2 * (2 - 1) * slice_numel * 4 // 2
        assert between >= (STEPS // H) * rail_ring
        assert between < (STEPS // H) * rail_ring + 4096  # plus the small agreement rounds
    for a, b in zip(results[0][0], results[1][0]):  # the ranks of a node hold the same parameters
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "combine, block, scale_bits, tie",
    [
        ("sign_vote", 0, 32, "exact"),
        ("sign_vote_ef", 0, 32, "exact"),
        ("sign_vote_ef", 5, 32, "exact"),
        ("sign_vote_ef", 5, 8, "exact"),
        ("scaled_sign", 0, 32, "exact"),
        ("sign_vote", 0, 32, "fast"),
        ("sign_vote_ef", 5, 16, "fast"),
    ],
)
def test_node_aware_one_bit_rounds_equal_the_node_level_reference(combine, block, scale_bits, tie):
    """2 nodes x 2 ranks: each rank votes its slice between the nodes with its own scales (blocks
    cut at the slice's edges), coins (counted from the slice's start) and error feedback, against
    the nodes as single workers."""
    results = run_distributed(_node_worker, 4, combine, block, scale_bits, tie)
    expected = _node_reference(2, 2, STEPS, combine, block, scale_bits, tie=tie)
    for rank, (history, _, _) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(
                got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}"
            )
    assert not torch.equal(results[0][0][-1], results[0][0][0])


# --- rounds on FSDP2's shards: FSDP2 inside each node, rounds between nodes ---------------------


def _fsdp_rounds_worker(rank, world_size, combine="mean", block=0, scale_bits=32, tie="exact"):
    from torch.distributed.fsdp import fully_shard

    from signmuon.optim import node_mesh

    mesh = node_mesh(2)  # 2 nodes x 2 ranks
    model = rounds_model()
    fully_shard(model, mesh=mesh["local"])  # FSDP2 averages the node's gradients every step
    inner = rounds_inner(model)
    refused = (
        capture(
            lambda: LocalStepAverager(period=H, pull=1.0, outer=OuterStep.diloco(), module=model)
        ),  # WORLD: 2 shards each
        capture(
            lambda: LocalStepAverager(
                period=H, pull=0.5, push=0.05, module=model, process_group=mesh["node"].get_group()
            )
        ),
    )
    outer = OuterStep.diloco()
    if combine != "mean":  # the ties the reference votes
        outer = OuterStep(
            optimizer=outer.optimizer,
            pseudo_gradient=combine,
            vote=VoteConfig(tie=tie),
            scale_block=block,
            scale_bits=scale_bits,
        )
    averager = LocalStepAverager(period=H, pull=1.0, outer=outer, module=model, process_group=mesh["node"].get_group())
    history = []
    for step in range(STEPS):
        inner.zero_grad()
        rounds_loss(model, rounds_batch(rank, step)).backward()
        inner.step()
        averager.average_parameters(model.parameters())
        history.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
    state = averager.consensus_state_dict(model)
    consensus = torch.cat([state[name].full_tensor().reshape(-1) for name, _ in model.named_parameters()])
    shard = sum(c.numel() for c in averager.consensus.tensors)
    return history, consensus, shard, refused, averager.stats.bytes_sent


def test_rounds_on_fsdp2_shards_equal_the_node_level_reference():
    results = run_distributed(_fsdp_rounds_worker, 4)
    expected = _node_reference(2, 2, STEPS)
    numel = expected[0][0].numel()
    for rank, (history, consensus, shard, refused, sent) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(
                got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}"
            )
        torch.testing.assert_close(consensus, expected[STEPS - STEPS % H - 1][0], rtol=1e-5, atol=1e-6)
        assert 0 < shard < numel  # each rank keeps the consensus of its shard only
        assert "holds 2 shards" in refused[0] and "push" in refused[1], refused
        rounds_ring = (STEPS // H) * shard * 4  # two nodes: a round sends this rank's shard once
        assert rounds_ring <= sent < rounds_ring + 4096, (sent, rounds_ring)
    assert sum(r[2] for r in results[:2]) == numel  # a node's two shards make the whole model


@pytest.mark.parametrize(
    "combine, block, scale_bits, tie",
    [
        ("sign_vote", 0, 32, "exact"),
        ("sign_vote_ef", 5, 8, "exact"),
        ("scaled_sign", 0, 32, "exact"),
        ("sign_vote", 0, 32, "fast"),
        ("sign_vote_ef", 5, 16, "fast"),
    ],
)
def test_one_bit_rounds_on_fsdp2_shards_equal_the_node_level_reference(combine, block, scale_bits, tie):
    """Each rank's rows of each tensor, voted with the same rows of the other node: scales per
    shard (blocks counted from each shard's first entry), coins and error feedback per shard."""
    results = run_distributed(_fsdp_rounds_worker, 4, combine, block, scale_bits, tie)
    expected = _node_reference(2, 2, STEPS, combine, block, scale_bits, partition=_fsdp_parts, tie=tie)
    for rank, (history, *_) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(
                got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}"
            )
