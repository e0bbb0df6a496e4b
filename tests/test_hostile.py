"""Hostile input and faults: what differs between ranks must fail cleanly on every rank (never
a process abort or a hang), one rank's NaN must stay on that rank, errors must leave training
usable, replica checks must compare bits, and checkpoints must be validated when loaded."""

import io
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import SignVoteState, VoteConfig, check_replicas, majority_vote, sign_vote_hook
from signmuon.comm_hooks.dist import settings_digest
from signmuon.integrations.deepspeed import SignCompressedBackend
from signmuon.optim import LocalStepAverager, SignMuon, SignSGDMV, SignumMV
from tests.harness import batch, capture, run_distributed, tiny_net

# --- sizes that differ between ranks ---------------------------------------------------------


def _sizes_worker(rank, world_size, sizes):
    x = -torch.ones(sizes[rank])
    error = capture(lambda: majority_vote(x, label="the test tensor"))
    after = majority_vote(torch.full((100,), -1.0 if rank else 1.0))  # the group still works
    return error, after


@pytest.mark.parametrize(
    "sizes",
    [(1000, 1000, 1003), (0, 10), (1000, 2000), (64, 64, 129)],
    ids=["same-words", "empty", "other-words", "other-words-3"],
)  # sizes that pack into different word counts used to abort the process (gloo SIGABRT)
def test_vote_sizes_that_differ_raise_on_every_rank(sizes):
    results = run_distributed(_sizes_worker, len(sizes), sizes, timeout=120)
    for rank, (error, after) in enumerate(results):
        assert error is not None and error.startswith("VoteMismatchError"), (rank, error)
        assert "the test tensor" in error and "entries" in error
        for r, size in enumerate(sizes):
            assert f"rank {r}: entries={size}" in error
        assert after.shape == (100,) and bool((after.abs() <= 1).all())


def _dtype_worker(rank, world_size):
    x = torch.ones(100, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    return capture(lambda: majority_vote(x))


def test_vote_dtypes_that_differ_raise_on_every_rank():
    for error in run_distributed(_dtype_worker, 2):
        assert error.startswith("VoteMismatchError") and "torch.bfloat16" in error and "torch.float32" in error


def _dppf_shape_worker(rank, world_size):
    torch.manual_seed(0)
    net = nn.Linear(4, 3 + rank)  # one rank's model is shaped differently
    net(torch.randn(2, 4)).sum().backward()
    averager = LocalStepAverager(period=1, pull=0.5)
    return capture(lambda: averager.average_parameters(net.parameters()))


def test_dppf_with_a_differently_shaped_model_raises_on_every_rank():
    for error in run_distributed(_dppf_shape_worker, 2):
        assert error.startswith("VoteMismatchError") and "local-step round" in error and "shapes" in error


def _replicas_count_worker(rank, world_size):
    tensors = [torch.ones(3) for _ in range(2 + rank)]
    return capture(lambda: check_replicas(tensors))


def test_check_replicas_with_different_tensor_counts_raises_on_every_rank():
    for error in run_distributed(_replicas_count_worker, 3):
        assert error.startswith("VoteMismatchError") and "rank 0: 2; rank 1: 3; rank 2: 4" in error


# --- parameters without a gradient on some ranks ---------------------------------------------


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 3)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.head_b(h) if use_b else self.head_a(h)


def _unused_worker(rank, world_size, kind, steps):
    net = _TwoHeads()
    config = VoteConfig(tie="exact")
    if kind == "signmuon":
        opt = SignMuon(net.parameters(), lr=0.01, vote=config, vote_in_step=True)
    else:
        opt = SignSGDMV(net.parameters(), lr=0.01, vote=config, vote_in_step=True)
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        use_b = rank == 1  # head_b has a gradient on rank 1 only, head_a on the others only
        nn.functional.cross_entropy(net(x, use_b), y).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}, grads


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["signmuon", "signsgd"])
def test_vote_in_step_with_rank_dependent_unused_parameters_keeps_replicas(world_size, kind):
    results = run_distributed(_unused_worker, world_size, kind, 3)
    params = [r[0] for r in results]
    for other in params[1:]:
        for name in params[0]:
            assert torch.equal(params[0][name], other[name]), name
    start = {n: p.detach() for n, p in _TwoHeads().named_parameters()}
    assert not torch.equal(params[0]["head_b.weight"], start["head_b.weight"]), "trained by rank 1 alone"
    if kind == "signsgd":  # a single-process reference: absent gradients vote 0
        expected = {n: p.clone() for n, p in start.items()}
        for step in range(3):
            for name in expected:
                signs = [torch.sign(g[step][name]) for _, g in results if g[step][name] is not None]
                expected[name] -= 0.01 * torch.sign(sum(signs))
        for name in expected:
            assert torch.allclose(params[0][name], expected[name], atol=1e-6), name


def _dppf_unused_worker(rank, world_size):
    net = _TwoHeads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    averager = LocalStepAverager(period=1, pull=1.0)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(net(x, rank == 1), y).backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    averager.average_parameters(net.parameters())
    return before, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_dppf_averages_parameters_with_a_gradient_on_any_rank():
    results = run_distributed(_dppf_unused_worker, 2)
    for name in results[0][1]:
        mean = (results[0][0][name] + results[1][0][name]) / 2
        for _, after in results:
            assert torch.allclose(after[name], mean, atol=1e-6), name


# --- DPPF and one rank's NaN -----------------------------------------------------------------


def _dppf_nan_worker(rank, world_size, nonfinite):
    torch.manual_seed(rank)
    net = nn.Linear(4, 3)
    net(torch.randn(2, 4)).sum().backward()
    if rank == 1:
        with torch.no_grad():
            net.weight[0, 0] = float("nan")
    averager = LocalStepAverager(period=1, pull=0.5, push=0.01, nonfinite=nonfinite)
    error = capture(lambda: averager.average_parameters(net.parameters()))
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    return error, finite, averager.stats.skipped, averager.rounds


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_dppf_never_spreads_one_ranks_nan(nonfinite):
    results = run_distributed(_dppf_nan_worker, 3, nonfinite)
    for rank, (error, finite, skipped, rounds) in enumerate(results):
        assert finite == (rank != 1), f"rank {rank}"
        assert skipped == 1 and rounds == 0
        if nonfinite == "raise":
            assert error.startswith("NonFiniteError") and "rank(s) [1]" in error
        else:
            assert error is None


# --- NonFiniteError leaves DDP usable ---------------------------------------------------------


def _raise_then_continue_worker(rank, world_size, kind):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0001)  # several buckets
    config = VoteConfig(nonfinite="raise")
    if kind == "signum":
        state = SignVoteState(momentum=0.9, start_iter=2, vote=config)
        model.register_comm_hook(state, sign_vote_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = SignMuon(net.parameters(), lr=0.01, vote=config)
        opt.register_comm_hook(model)
    log = []
    for step in range(6):
        x, y = batch(rank, step)
        if rank == 1 and step in (0, 3):  # step 0: the warm-up all-reduce (signum); 3: a vote
            x[0, 0] = float("nan")
        opt.zero_grad()
        error = capture(lambda: nn.functional.cross_entropy(model(x), y).backward())
        if error is None:
            opt.step()
        log.append(error)
    return log, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("kind", ["signum", "signmuon"])
def test_training_continues_after_a_caught_nonfinite_error(kind):
    results = run_distributed(_raise_then_continue_worker, 2, kind)
    for log, params in results:
        raised = [i for i, e in enumerate(log) if e]
        assert raised == ([0, 3] if kind == "signum" else [0, 3]), log
        assert all(log[i].startswith("NonFiniteError") for i in raised), log
        assert all(bool(torch.isfinite(p).all()) for p in params)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert not all(torch.equal(a, p.detach()) for a, p in zip(results[0][1], tiny_net().parameters())), "it trained"


# --- stale iteration counters, world sizes, settings -------------------------------------------


def _stale_worker(rank, world_size, start_iter, check_every):
    model = DDP(tiny_net())
    state = SignVoteState(start_iter=start_iter, check_replicas_every=check_every)
    if rank == 1:
        state.iter = 5  # a state restored from an older checkpoint on this rank only
    model.register_comm_hook(state, sign_vote_hook)
    x, y = batch(rank, 0)
    return capture(lambda: nn.functional.cross_entropy(model(x), y).backward())


@pytest.mark.parametrize("start_iter, check_every", [(0, 0), (0, 5), (3, 0)], ids=["vote", "replica-check", "warmup"])
def test_stale_iteration_counter_raises_on_every_rank(start_iter, check_every):
    for error in run_distributed(_stale_worker, 2, start_iter, check_every, timeout=120):
        assert error is not None and "VoteMismatchError" in error and "iteration" in error, error
        assert "rank 0: iteration=0" in error and "rank 1: iteration=5" in error


def _save_worker(rank, world_size):
    net = tiny_net()
    model = DDP(net)
    opt = SignMuon(net.parameters(), lr=0.01)
    opt.register_comm_hook(model)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state = SignVoteState(momentum=0.9)
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "hook": state.state_dict()}, buffer)
    return buffer.getvalue()


def test_resume_on_another_world_size_raises_with_per_rank_files():
    saved = run_distributed(_save_worker, 2)
    checkpoint = torch.load(io.BytesIO(saved[1]), weights_only=True)  # our state dicts need no unpickling
    net = tiny_net()
    opt = SignMuon(net.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="2 rank.*1 rank.*same number of ranks"):
        opt.load_state_dict(checkpoint["opt"])
    with pytest.raises(ValueError, match="2 ranks.*1 ranks.*same number of ranks"):
        SignVoteState(momentum=0.9).load_state_dict(checkpoint["hook"])


def _checkpoint_flag_worker(rank, world_size):
    net = tiny_net()
    opt = SignMuon(net.parameters(), lr=0.01, vote_in_step=True, checkpoint_all_ranks=rank == 0)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(net(x), y).backward()
    return capture(opt.step)


def test_checkpoint_all_ranks_is_compared_across_ranks():
    for error in run_distributed(_checkpoint_flag_worker, 2):
        assert error.startswith("SettingsMismatchError") and "checkpoint_all_ranks" in error


def test_settings_compare_numbers_by_value():
    assert settings_digest({"lr": np.float64(0.001), "steps": np.int64(5)}) == settings_digest(
        {"lr": 0.001, "steps": 5}
    )
    assert settings_digest({"betas": (0.9, 2)}) == settings_digest({"betas": [np.float64(0.9), 2.0]})
    assert settings_digest({"lr": 0.001}) != settings_digest({"lr": 0.0011})
    assert settings_digest({"flag": True}) != settings_digest({"flag": 1})


# --- bit-exact replica checks -----------------------------------------------------------------


def _replica_bits_worker(rank, world_size, case):
    if case == "swapped":  # the same tensors, in another order
        a, b = torch.arange(6.0), torch.arange(6.0) + 1
        tensors = [a, b] if rank == 0 else [b, a]
    elif case == "ulp":
        big = torch.tensor([1e30, 1.0, 2.0])
        if rank == 1:
            big[1] = torch.nextafter(big[1], torch.tensor(2.0))
        tensors = [torch.zeros(2), big]
    elif case == "permuted":
        x = torch.arange(8.0)
        tensors = [x if rank == 0 else x.flip(0)]
    else:  # identical NaN
        tensors = [torch.tensor([1.0, float("nan"), 3.0])]
    return capture(lambda: check_replicas(tensors, names=[f"t{i}" for i in range(len(tensors))]))


CASES = ("swapped", "ulp", "permuted", "nan")


def _replica_cases_worker(rank, world_size):
    return [_replica_bits_worker(rank, world_size, case) for case in CASES]  # one group for all cases


def test_check_replicas_compares_bits():
    for errors in run_distributed(_replica_cases_worker, 2):
        for case, error in zip(CASES, errors):
            if case == "nan":
                assert error is None, "identical NaNs are identical replicas"
            else:
                first = "t1" if case == "ulp" else "t0"
                assert error.startswith("ReplicaDivergenceError"), (case, error)
                assert f"{first} differs in its bits on rank(s) [1]" in error, (case, error)


# --- loading ---------------------------------------------------------------------------------


def test_load_state_dict_validates_shapes_keys_and_dtypes():
    net = tiny_net()
    opt = SignMuon(net.parameters(), lr=0.01, non_matrix="adamw")
    good = opt.state_dict()
    bad_shape = {**good, "state": {**good["state"], 0: {"momentum_buffer": torch.zeros(4)}}}
    with pytest.raises(ValueError, match=r"parameter 0 .*momentum_buffer is \(4,\), expected shape \(12, 6\)"):
        opt.load_state_dict(bad_shape)
    bad_keys = {**good, "state": {**good["state"], 1: {"momentum_buffer": torch.zeros(12)}}}
    with pytest.raises(ValueError, match="parameter 1 .*keys"):
        opt.load_state_dict(bad_keys)
    bad_dtype = {**good, "state": {**good["state"], 0: {"momentum_buffer": torch.zeros(12, 6, dtype=torch.int64)}}}
    with pytest.raises(ValueError, match="dtype torch.int64"):
        opt.load_state_dict(bad_dtype)
    opt.load_state_dict(good)  # the untouched one still loads


def _weights_only_worker(rank, world_size):
    net = tiny_net()
    loaded = []
    for opt in (
        SignMuon(net.parameters(), lr=0.01, vote_in_step=True, checkpoint_all_ranks=True),
        SignumMV(net.parameters(), lr=0.01, vote_in_step=True),
    ):
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)  # checkpoint_all_ranks: every rank's state gathered
        buffer.seek(0)
        opt.load_state_dict(torch.load(buffer, weights_only=True))
        loaded.append(type(opt).__name__)
    for state in (SignVoteState(momentum=0.9).state_dict(), LocalStepAverager(period=2, push=0.1).state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded.append(sorted(torch.load(buffer, weights_only=True)) == sorted(state))
    return loaded


def test_state_dicts_load_with_weights_only():
    for loaded in run_distributed(_weights_only_worker, 2):
        assert loaded == ["SignMuon", "SignumMV", True, True]


def test_hook_momentum_of_the_wrong_size_raises_when_placed():
    state = SignVoteState(momentum=0.9)
    saved = state.state_dict()
    with pytest.raises(ValueError, match="momentum.*float"):
        state.load_state_dict({**saved, "momentum": {0: torch.zeros(3, dtype=torch.int64)}})


# --- small inputs that used to fail obscurely ---------------------------------------------------


def test_sparse_and_empty_inputs_give_clear_errors():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = SignMuon(emb.parameters(), lr=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse.*dense gradients"):
        opt.step()
    with pytest.raises(ValueError, match="empty matrix"):
        SignMuon([nn.Parameter(torch.zeros(0, 5))], lr=0.01)
    csr = torch.eye(4).to_sparse_csr()
    with pytest.raises(ValueError, match="sparse"):
        majority_vote(csr)
    for push in (math.inf, math.nan):
        with pytest.raises(ValueError, match="push"):
            LocalStepAverager(period=1, push=push)


def _backend_worker(rank, world_size):
    backend = SignCompressedBackend()
    buffer = torch.full((64,), 3e38)
    worker_error, server_error = torch.zeros(64), torch.zeros(64 // world_size)
    backend.compressed_allreduce(buffer, worker_error, server_error)
    return buffer


def test_compressed_backend_does_not_overflow_on_finite_input():
    for result in run_distributed(_backend_worker, 2):
        assert bool(torch.isfinite(result).all()) and torch.allclose(result, torch.full((64,), 3e38), rtol=1e-5)
