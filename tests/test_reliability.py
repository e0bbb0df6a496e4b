"""Faults, bad input and resumption: NaN/Inf, Byzantine ranks, divergent replicas, mismatched
settings, uneven inputs (DDP join), dead ranks, and resuming mid-warm-up or mid-period."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import (
    ByzantineFault,
    CommStats,
    SignVoteState,
    VoteConfig,
    check_replicas,
    majority_vote,
    sign_vote_hook,
)
from signmuon.optim import LocalStepAverager, SignMuon
from tests.harness import batch, capture, run_distributed, tiny_net

# --- non-finite gradients ------------------------------------------------------------------


def _nonfinite_collective_worker(rank, world_size):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        x[17] = float("nan")
    stats = CommStats()
    skipped = majority_vote(x, stats=stats)
    raised = capture(lambda: majority_vote(x, config=VoteConfig(nonfinite="raise")))
    clean = majority_vote(torch.randn(1000, generator=torch.Generator().manual_seed(rank)), stats=stats)
    return skipped, stats.skipped, raised, clean


@pytest.mark.parametrize("world_size", [2, 3])
def test_nonfinite_input_is_skipped_or_raised_on_every_rank(world_size):
    results = run_distributed(_nonfinite_collective_worker, world_size)
    for skipped, count, raised, clean in results:
        assert torch.equal(skipped, torch.zeros(1000)) and count == 1
        assert raised.startswith("NonFiniteError") and "rank(s) [1]" in raised
        assert clean.abs().sum() > 0, "the next call votes normally"


def _nonfinite_training_worker(rank, world_size, kind):
    net = tiny_net()
    model = DDP(net)
    if kind == "signum":
        state = SignVoteState(momentum=0.9, start_iter=1)
        model.register_comm_hook(state, sign_vote_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        stats = state.stats
    else:
        opt = SignMuon(net.parameters(), lr=0.01, non_matrix="adamw")
        opt.register_comm_hook(model)
        stats = opt.comm_state.stats
    before_bad = None
    for step in range(5):
        x, y = batch(rank, step)
        if step == 3 and rank == 0:
            x[0, 0] = float("inf")  # poisons every gradient on rank 0 (NaN through tanh' and softmax)
            before_bad = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 3:
            moved = [not torch.equal(a, b) for a, b in zip(before_bad or [], net.parameters())]
    momenta = (
        state.momentum_buffers.values()
        if kind == "signum"
        else [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    )
    return dict(
        params=[p.detach().clone() for p in net.parameters()],
        finite=all(torch.isfinite(p).all() for p in net.parameters()),
        momentum_finite=all(torch.isfinite(m).all() for m in momenta),
        skipped=stats.skipped + (opt.stats.skipped if kind == "signmuon" else 0),
        moved=moved,
    )


@pytest.mark.parametrize("kind", ["signum", "signmuon"])
def test_nan_in_one_rank_never_reaches_parameters_or_momentum(kind):
    results = run_distributed(_nonfinite_training_worker, 2, kind)
    for r in results:
        assert r["finite"] and r["momentum_finite"]
        assert r["skipped"] >= 1
    assert not any(results[0]["moved"]) or kind == "signmuon", "the bad step moved nothing (Signum)"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "replicas diverged"


def _bad_averaged_gradient_worker(rank, world_size, nonfinite):
    net = tiny_net()
    opt = SignMuon(
        net.parameters(), lr=0.01, non_matrix="adamw", vote_in_step=True, vote=VoteConfig(nonfinite=nonfinite)
    )
    before = [p.detach().clone() for p in net.parameters()]
    for index, p in enumerate(net.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * rank + index))
    if rank == 0:
        net[2].bias.grad[1] = float("nan")  # an AdamW-routed parameter: its all-reduced mean is NaN everywhere
    raised = capture(opt.step)
    moved = [not torch.equal(a, b) for a, b in zip(before, net.parameters())]
    return raised, moved, opt.stats.skipped


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_bad_averaged_gradient_is_skipped_or_raised_on_every_rank(nonfinite):
    """SignMuon's AdamW path reads all its mean gradients' flags at once: a NaN in one of them
    skips that parameter alone (counted), or raises on every rank before anything moves."""
    for raised, moved, skipped in run_distributed(_bad_averaged_gradient_worker, 2, nonfinite):
        if nonfinite == "skip":
            assert raised is None and moved == [True, True, True, False] and skipped == 1, (raised, moved)
        else:
            assert raised.startswith("NonFiniteError") and "averaged gradient of a parameter of shape (3,)" in raised
            assert moved == [False] * 4


# --- Byzantine workers -----------------------------------------------------------------------


def test_byzantine_fault_flips_only_faulty_ranks():
    x = torch.tensor([1.0, -2.0, 0.0])
    assert majority_vote(x, config=VoteConfig(fault=ByzantineFault(ranks=(0,)))).tolist() == [-1.0, 1.0, 0.0]
    assert majority_vote(x, config=VoteConfig(fault=ByzantineFault(ranks=(3,)))).tolist() == [1.0, -1.0, 0.0]
    with pytest.raises(ValueError, match="mode"):
        ByzantineFault(ranks=(0,), mode="lie")


# --- replica consistency and settings mismatch ---------------------------------------------------


def _replica_worker(rank, world_size):
    net = tiny_net()
    model = DDP(net)
    model.register_comm_hook(SignVoteState(start_iter=0, check_replicas_every=2), sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    errors = []
    for step in range(4):
        if step == 1 and rank == 1:
            with torch.no_grad():
                net[2].bias[0] += 1e-3  # a silent divergence
        opt.zero_grad()
        x, y = batch(rank, step)
        errors.append(capture(lambda: nn.functional.cross_entropy(model(x), y).backward()))
        if errors[-1]:
            break
        opt.step()
    standalone = capture(lambda: check_replicas(net))
    return errors, standalone


def test_divergent_replicas_are_named():
    for errors, standalone in run_distributed(_replica_worker, 2):
        assert errors[:2] == [None, None], "step 0 checks equal replicas, step 1 does not check"
        assert errors[2].startswith("ReplicaDivergenceError") and "rank(s) [1]" in errors[2]
        assert "shape (3,)" in errors[2]
        assert "2.bias differs in its bits on rank(s) [1]" in standalone


def _mismatch_worker(rank, world_size):
    errors = {}
    model = DDP(tiny_net())
    model.register_comm_hook(SignVoteState(momentum=0.9 if rank == 0 else 0.5, start_iter=1), sign_vote_hook)
    x, y = batch(rank, 0)
    errors["hook"] = capture(lambda: nn.functional.cross_entropy(model(x), y).backward())
    net = tiny_net()
    opt = SignMuon(net.parameters(), lr=0.01, ns_steps=5 + rank, vote_in_step=True)
    nn.functional.cross_entropy(net(x), y).backward()
    errors["signmuon"] = capture(opt.step)
    averager = LocalStepAverager(period=4 + rank, pull=0.5)
    errors["dppf"] = capture(lambda: averager.average_parameters(net.parameters()))
    return errors


def test_mismatched_settings_raise_on_every_rank():
    for errors in run_distributed(_mismatch_worker, 2):
        for what in ("hook", "signmuon", "dppf"):
            assert errors[what].startswith("SettingsMismatchError") and "rank(s) [1]" in errors[what], errors[what]
        # the differing field first, with both ranks' values
        assert "in momentum (rank 0: 0.9, rank 1: 0.5)" in errors["hook"], errors["hook"]


# --- uneven inputs and dead ranks ------------------------------------------------------------


def _join_worker(rank, world_size):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0001)  # several buckets, so the pipelined votes are exercised
    state = SignVoteState(start_iter=0)
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Join([model]):
        for step in range(3 + 2 * rank):  # rank 1 has two more batches
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in net.parameters()], state.iter


def test_join_with_uneven_inputs_keeps_replicas_identical():
    # A joined rank runs the hook on zero gradients: it abstains from the vote.
    (a, iters_a), (b, iters_b) = run_distributed(_join_worker, 2, timeout=120)
    assert iters_a == iters_b == 5
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _dead_rank_worker(rank, world_size, out_dir):
    group = dist.new_group(timeout=timedelta(seconds=3))
    dist.barrier(group=group)  # every rank connected before one dies
    if rank == world_size - 1:
        time.sleep(0.5)  # let the barrier's last messages land
        os._exit(0)  # dies before the vote
    start = time.monotonic()
    outcome = capture(lambda: majority_vote(torch.randn(4096), group))
    torch.save((outcome, time.monotonic() - start), os.path.join(out_dir, f"survivor{rank}.pt"))
    os._exit(0)  # the default group has a dead member too: leave without its barrier


def test_dead_rank_fails_the_others_within_the_timeout(tmp_path):
    run_distributed(_dead_rank_worker, 3, str(tmp_path), timeout=120)
    for rank in range(2):
        outcome, elapsed = torch.load(tmp_path / f"survivor{rank}.pt")
        assert outcome is not None, "the vote must fail, not succeed or hang"
        assert elapsed < 30


# --- resumption mid-warm-up and mid-period ---------------------------------------------------


def _resume_worker(rank, world_size, steps, load, save, tie="exact"):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.001)  # several buckets, which DDP rebuilds after a restart
    # Fast-mode coins are keyed to (seed, iteration, parameter, position), not to the bucket
    # layout, so they too are drawn the same after a restart.
    state = SignVoteState(momentum=0.9, start_iter=3, vote=VoteConfig(tie=tie, seed=5))
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = LocalStepAverager(period=3, warmup_steps=1, pull=0.5, push=0.01)
    start = 0
    if load:
        saved = torch.load(f"{load}.rank{rank}", weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
        averager.load_state_dict(saved["averager"])
        start = saved["step"]
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        averager.average_parameters(net.parameters())
    if save:
        torch.save(
            {
                "model": net.state_dict(),
                "opt": opt.state_dict(),
                "hook": state.state_dict(),
                "averager": averager.state_dict(),
                "step": start + steps,
            },
            f"{save}.rank{rank}",
        )
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("tie", ["exact", "fast"])
@pytest.mark.parametrize("split", [2, 5])  # 2: inside the all-reduce warm-up; 5: inside a DPPF period
def test_resume_is_bit_identical(tmp_path, split, tie):
    whole = run_distributed(_resume_worker, 2, 8, None, None, tie)
    run_distributed(_resume_worker, 2, split, None, str(tmp_path / "ckpt"), tie)
    resumed = run_distributed(_resume_worker, 2, 8 - split, str(tmp_path / "ckpt"), None, tie)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(whole[r], resumed[r])), f"rank {r} differs"
