"""The node-aware vote (VoteConfig(hierarchical=True)) on gloo ranks grouped into "nodes":
equal to a single-process reference that votes the node means (Signum-MV, signSGD-MV) or the
node-level Newton–Schulz directions (SignMuon); identical replicas; resume; the flat cases;
bad layouts; bytes split into inside and between nodes."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import SignVoteState, VoteConfig, sign_vote_hook, vote_bytes_per_rank
from signmuon.optim import SignMuon, SignumMV
from tests.harness import batch, node_means, node_reference_step, run_distributed, tiny_net, vote_nodes

LR, BETA = 0.01, 0.9


def _hook_worker(rank, world_size, kind, per_node, steps):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0005)  # several buckets
    config = VoteConfig(tie="exact", hierarchical=True, ranks_per_node=per_node)
    if kind == "signmuon":
        opt = SignMuon(net.parameters(), lr=LR, momentum=BETA, vote=config)
        state = opt.register_comm_hook(model)
    else:
        state = SignVoteState(momentum=BETA if kind == "signum" else 0.0, start_iter=1, vote=config)
        model.register_comm_hook(state, sign_vote_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    trajectory = [[p.detach().clone() for p in net.parameters()]]
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in net.parameters()])
    return trajectory, state.stats.state_dict()


@pytest.mark.parametrize(
    "kind, world_size, per_node",
    [("signum", 4, 2), ("signum", 6, 2), ("signsgd", 4, 2), ("signmuon", 4, 2), ("signmuon", 6, 2)],
)
def test_node_aware_hook_equals_node_level_reference(kind, world_size, per_node):
    steps, nodes = 4, world_size // per_node
    results = run_distributed(_hook_worker, world_size, kind, per_node, steps)
    trajectory = results[0][0]
    for other, _ in results[1:]:
        for a, b in zip(trajectory[-1], other[-1]):
            assert torch.equal(a, b), "replicas must stay identical"
    start = 0 if kind == "signmuon" else 1  # the Signum hooks warm up with one all-reduce step
    momenta = [[torch.zeros_like(p) for p in trajectory[0]] for _ in range(nodes)]
    for step in range(start, steps):
        expected = node_reference_step(kind, trajectory[step], step, nodes, per_node, momenta, LR, BETA)
        for a, b in zip(trajectory[step + 1], expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{kind} step {step}")
    moved = [not torch.equal(a, b) for a, b in zip(trajectory[-1], trajectory[0])]
    assert all(moved)


def _in_step_worker(rank, world_size, per_node, steps):
    net = tiny_net()
    config = VoteConfig(tie="exact", hierarchical=True, ranks_per_node=per_node)
    opt = SignumMV(net.parameters(), lr=LR, momentum=BETA, vote=config, vote_in_step=True)
    trajectory = [[p.detach().clone() for p in net.parameters()]]
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in net.parameters()])
    return trajectory


def test_node_aware_vote_in_step_equals_node_level_reference():
    world_size, per_node, steps = 4, 2, 3
    results = run_distributed(_in_step_worker, world_size, per_node, steps)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][-1], other[-1]))
    momenta = [[torch.zeros_like(p) for p in results[0][0]] for _ in range(2)]
    for step in range(steps):
        # SignumMV's momentum is torch's lerp form: m <- m + (1 - beta)(g - m)
        means = node_means(results[0][step], step, 2, per_node)
        momenta = [[m.lerp(g, 1 - BETA) for m, g in zip(momenta[n], means[n])] for n in range(2)]
        expected = [p - LR * v for p, v in zip(results[0][step], vote_nodes(momenta))]
        for a, b in zip(results[0][step + 1], expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# --- flat cases, bytes, layouts -------------------------------------------------------------------


def _flat_worker(rank, world_size, hierarchical, per_node):
    net = tiny_net()
    model = DDP(net)
    config = VoteConfig(hierarchical=True, ranks_per_node=per_node) if hierarchical else VoteConfig()
    state = SignVoteState(momentum=BETA, start_iter=1, vote=config)
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _flat_cases_worker(rank, world_size):
    # One process group for the three runs: each builds its own model, DDP and hook state.
    return [_flat_worker(rank, world_size, False, None)] + [_flat_worker(rank, world_size, True, L) for L in (1, 4)]


def test_one_node_or_one_rank_per_node_is_the_flat_vote():
    for flat, one_per_node, one_node in run_distributed(_flat_cases_worker, 4):
        assert all(torch.equal(x, y) for x, y in zip(flat, one_per_node)), "one rank per node"
        assert all(torch.equal(x, y) for x, y in zip(flat, one_node)), "one node"


def _bytes_worker(rank, world_size, per_node, n):
    import torch.distributed as dist

    from signmuon.comm_hooks import CommStats, node_layout
    from signmuon.comm_hooks.vote import NodeVoteWork

    layout = node_layout(None, per_node)
    stats = CommStats()
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    out = NodeVoteWork(x.clone(), layout, VoteConfig(hierarchical=True), out=torch.empty(n), stats=stats).wait()
    dist.barrier()
    return stats.bytes_sent_between_nodes, stats.bytes_sent_inside_node, out, x


@pytest.mark.parametrize("world_size, per_node", [(4, 2), (6, 2), (6, 3)])
def test_between_node_bytes_follow_the_formula(world_size, per_node):
    n = 10_000
    results = run_distributed(_bytes_worker, world_size, per_node, n)
    nodes = world_size // per_node
    c = -(-n // per_node)
    for rank, (between, inside, out, _) in enumerate(results):
        local = rank % per_node
        size = min(n, (local + 1) * c) - min(n, local * c)
        assert between == vote_bytes_per_rank(size, nodes, agree_sizes=False)
        assert inside == 2 * (per_node - 1) * n * 4 // per_node + (per_node - 1) * c
        assert torch.equal(out, results[0][2])
    per_node_total = sum(r[0] for r in results[:per_node])
    assert per_node_total <= 2 * (nodes - 1) / nodes * n / 8 + 64 * per_node * nodes  # about 2(N-1)/N n/8
    means = [sum(results[n * per_node + i][3] for i in range(per_node)) / per_node for n in range(nodes)]
    expected = torch.sign(sum(torch.sign(m) for m in means))
    ties = expected == 0
    assert torch.equal(results[0][2][~ties], expected[~ties])


def _staged_worker(rank, world_size):
    # Two node-aware votes in flight, as a DDP hook keeps them: each stage call moves a vote one
    # step on, and the node all-reduce is issued asynchronously, before the vote's first stage.
    import torch.distributed as dist

    from signmuon.comm_hooks import node_layout
    from signmuon.comm_hooks.vote import NodeVoteWork

    layout = node_layout(None, 2)
    issued = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        issued.append(kwargs.get("async_op", False))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        gen = torch.Generator().manual_seed(rank)
        xs = [torch.randn(1000, generator=gen) for _ in range(2)]
        works = [
            NodeVoteWork(x.clone(), layout, VoteConfig(hierarchical=True), out=torch.empty(1000), tag=i)
            for i, x in enumerate(xs)
        ]
        stages = []
        for work in works:
            work.advance()
            stages.append(work.advanced)  # the first stage only started the rail vote
            work.advance()
            stages.append(work.advanced)
        voted = [w.wait() for w in works]
        alone = [
            NodeVoteWork(x.clone(), layout, VoteConfig(hierarchical=True), out=torch.empty(1000)).wait() for x in xs
        ]
    finally:
        dist.all_reduce = all_reduce
    return issued[:2], stages, voted, alone


def test_the_node_aware_vote_starts_its_node_all_reduce_asynchronously_and_takes_a_stage_per_call():
    for issued, stages, voted, alone in run_distributed(_staged_worker, 4):
        assert issued == [True, True], "the node mean blocked the hook"
        assert stages == [False, True, False, True]
        assert all(torch.equal(v, a) for v, a in zip(voted, alone))


def _owned_staged_worker(rank, world_size):
    # SignMuon's node-aware hook keeps these in its pipeline: the node all-reduce is started
    # asynchronously, the owners' directions wait for the first stage, and the result equals
    # the vote run to the end at once.
    import torch.distributed as dist

    from signmuon.comm_hooks import node_layout
    from signmuon.comm_hooks.vote import OwnedVoteWork

    layout = node_layout(None, 2)
    gen = torch.Generator().manual_seed(rank)
    shapes = [(8, 6), (5,), (6, 6)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    owner, keys = [0, 1, 1], [0, 1, 2]
    calls = []

    def directions(i, mean):
        calls.append(i)
        return mean * (i + 1)

    issued, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (issued.append(k.get("async_op", False)), all_reduce(t, *a, **k))[1]
    try:
        staged = [g.clone() for g in grads]
        work = OwnedVoteWork(
            staged,
            directions,
            owner,
            keys,
            layout,
            VoteConfig(hierarchical=True),
            step=3,
            stats=None,
            label="test",
            tag=7,
        )
        before = list(calls)
        work.advance()
        after_first = (list(calls), work.advanced)
        work.advance()
        exchanged = work.advanced
        work.wait()
    finally:
        dist.all_reduce = all_reduce
    alone = [g.clone() for g in grads]
    OwnedVoteWork(
        alone,
        lambda i, mean: mean * (i + 1),
        owner,
        keys,
        layout,
        VoteConfig(hierarchical=True),
        step=3,
        stats=None,
        label="test",
        tag=7,
    ).wait()
    return issued[0], before, after_first, exchanged, staged, alone


def test_owned_votes_start_the_node_mean_asynchronously_and_compute_directions_at_the_first_stage():
    for rank, (issued, before, (after, exchanged_early), exchanged, staged, alone) in enumerate(
        run_distributed(_owned_staged_worker, 4)
    ):
        assert issued is True, "the node mean blocked the hook"
        assert before == [] and not exchanged_early and exchanged
        assert after == ([0] if rank % 2 == 0 else [1, 2])  # each local rank computes its own tensors' directions
        assert all(torch.equal(a, b) for a, b in zip(staged, alone))
        assert all(set(t.unique().tolist()) <= {-1.0, 0.0, 1.0} for t in staged)


def _layout_worker(rank, world_size, env):
    os.environ.update({k: v[rank] for k, v in env.items()})
    from signmuon.comm_hooks import node_layout

    try:
        node_layout(None, None)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"LOCAL_WORLD_SIZE": ["2", "2", "3", "2"]}, "nodes of different sizes"),
        (
            {"LOCAL_WORLD_SIZE": ["2"] * 4, "GROUP_RANK": ["0", "1", "0", "1"], "LOCAL_RANK": ["0", "0", "1", "1"]},
            "not node-contiguous",
        ),
        ({"LOCAL_WORLD_SIZE": ["3"] * 4}, "divide the world size"),
    ],
    ids=["sizes", "interleaved", "indivisible"],
)
def test_bad_layout_fails_on_every_rank(env, match):
    for message in run_distributed(_layout_worker, 4, env):
        assert message is not None and match in message, message


def _train_steps(model, opt, rank, steps):
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _resume_worker(rank, world_size, steps, load, save):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0005)
    opt = SignMuon(net.parameters(), lr=LR, vote=VoteConfig(hierarchical=True, ranks_per_node=2, seed=3))
    opt.register_comm_hook(model)
    start = 0
    if load:
        saved = torch.load(f"{load}.rank{rank}", weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    _train_steps(model, opt, rank, range(start, start + steps))
    if save:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": start + steps}, f"{save}.rank{rank}")
    return [p.detach().clone() for p in net.parameters()]


def test_node_aware_signmuon_resumes_bit_identically(tmp_path):
    whole = run_distributed(_resume_worker, 4, 6, None, None)
    run_distributed(_resume_worker, 4, 3, None, str(tmp_path / "ckpt"))
    resumed = run_distributed(_resume_worker, 4, 3, str(tmp_path / "ckpt"), None)
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(whole[r], resumed[r])), f"rank {r}"


def _signum_resume_worker(rank, world_size, steps, load, save, whole_pieces):
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0005)  # several buckets, cut anew when DDP re-buckets
    state = SignVoteState(momentum=BETA, start_iter=1, vote=VoteConfig(hierarchical=True, ranks_per_node=2, seed=3))
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = 0
    if load:
        saved = torch.load(f"{load}.rank{rank}", weights_only=True)
        net.load_state_dict(saved["model"])
        state.load_state_dict(saved["whole" if whole_pieces else "hook"])
        start = saved["step"]
    _train_steps(model, opt, rank, range(start, start + steps))
    if save:
        hook = state.state_dict()
        # The node's momentum, whole on every rank, as the hook kept it before the slices.
        whole = {state.param_key(p): torch.zeros(p.numel()) for p in net.parameters()}
        for key, piece in hook["momentum"].items():
            first = hook["momentum_starts"].get(key, 0)
            whole[key][first : first + piece.numel()] = piece
        node_group = state.layout.node_group
        for piece in whole.values():
            torch.distributed.all_reduce(piece, group=node_group)  # the node's slices are disjoint
        whole_state = {**hook, "momentum": whole, "momentum_starts": {}}
        torch.save(
            {"model": net.state_dict(), "hook": hook, "whole": whole_state, "step": start + steps}, f"{save}.rank{rank}"
        )
    held = sum(buf.numel() for buf in state.momentum_buffers.values())
    return [p.detach().clone() for p in net.parameters()], held, sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("whole_pieces", [False, True], ids=["slices", "whole-momentum-checkpoint"])
def test_node_aware_signum_hook_keeps_a_slice_and_resumes_bit_identically(tmp_path, whole_pieces):
    whole = run_distributed(_signum_resume_worker, 4, 6, None, None, False)
    for params, held, total in whole:
        assert total // 2 <= held <= total // 2 + 16, "each of 2 local ranks holds about half the momentum"
    run_distributed(_signum_resume_worker, 4, 3, None, str(tmp_path / "ckpt"), False)
    resumed = run_distributed(_signum_resume_worker, 4, 3, str(tmp_path / "ckpt"), None, whole_pieces)
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(whole[r][0], resumed[r][0])), f"rank {r}"
        assert resumed[r][1] == whole[r][1]
    saved = torch.load(f"{tmp_path / 'ckpt'}.rank1", weights_only=True)["hook"]
    assert saved["rank"] == 1 and saved["momentum_starts"], "a parameter split over the node's two slices"


def _nan_in_one_slice_worker(rank, world_size):
    net = tiny_net()
    model = DDP(net)  # one bucket, split between the node's two slices
    state = SignVoteState(momentum=BETA, start_iter=1, vote=VoteConfig(hierarchical=True, ranks_per_node=2))
    model.register_comm_hook(state, sign_vote_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    last = list(net.parameters())[-1]
    poison = {"on": False}
    last.register_hook(lambda g: g.index_fill(0, torch.tensor([g.shape[0] - 1]), float("nan")) if poison["on"] else g)
    snapshots = []
    for step in range(4):
        poison["on"] = rank == 1 and step == 2  # one entry, near the bucket's end: in local rank 1's slice
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        momentum = state.state_dict()["momentum"]
        snapshots.append(([p.detach().clone() for p in net.parameters()], {k: v.clone() for k, v in momentum.items()}))
    return snapshots, state.stats.skipped


def test_a_nan_in_one_local_ranks_slice_skips_the_bucket_on_every_rank():
    results = run_distributed(_nan_in_one_slice_worker, 4)
    for rank, (snapshots, skipped) in enumerate(results):
        assert skipped == 1
        before, after = snapshots[1], snapshots[2]
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "the poisoned step moves nothing"
        assert before[1].keys() == after[1].keys()
        kept = all(torch.equal(before[1][k], after[1][k]) for k in before[1])
        # Node 0's mean holds the NaN: neither of its slices takes it; node 1's mean is finite.
        assert kept == (rank < 2), f"rank {rank}"
        assert all(torch.isfinite(v).all() for v in after[1].values())
        assert not all(torch.equal(a, b) for a, b in zip(after[0], snapshots[3][0])), "the next step moves again"
    for snapshots, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0][-1][0], snapshots[-1][0]))


def _merge_worker(rank, world_size):
    from signmuon.comm_hooks import CommStats, node_layout
    from signmuon.comm_hooks.vote import merge_in_node

    layout = node_layout(None, 2)
    values = torch.full((6,), float(10 * rank + 1)) + torch.arange(6.0)
    held = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]][layout.local_rank], dtype=torch.bool)
    stats = CommStats()
    merge_in_node(values, held, layout, stats)
    return values, stats.bytes_sent_inside_node, stats.bytes_sent_between_nodes


def test_merge_in_node_takes_the_lowest_holder_and_zeroes_what_none_holds():
    results = run_distributed(_merge_worker, 4)
    for rank, (values, inside, between) in enumerate(results):
        first = 10 * (rank - rank % 2)  # the node's local rank 0
        expected = torch.tensor([first + 1, first + 2, first + 10 + 1 + 2, 0, first + 5, 0])
        assert torch.equal(values, expected), (rank, values)
        assert inside == 6 * 4 + 6 * 4 and between == 0  # two ring all-reduces of 2 ranks: int32 holders, values


def test_a_rank_refuses_another_ranks_momentum_and_a_flat_hook_a_slice():
    state = SignVoteState(momentum=0.9, start_iter=1)
    saved = {**state.state_dict(), "rank": 3, "momentum": {0: torch.zeros(4)}}
    with pytest.raises(ValueError, match="rank 0 is loading the hook state rank 3 saved"):
        state.load_state_dict(saved)
    state.load_state_dict({**saved, "momentum": {}})  # no momentum: nothing of another rank's is taken
    with pytest.raises(ValueError, match="momentum start of parameter 0"):
        state.load_state_dict({**saved, "rank": 0, "momentum_starts": {0: -1}})


def _slice_into_flat_worker(rank, world_size):
    net = tiny_net()
    model = DDP(net)
    state = SignVoteState(momentum=BETA, start_iter=1)
    first = next(net.parameters())
    state.load_state_dict(
        {**state.state_dict(), "iter": 1, "momentum": {0: torch.zeros(first.numel() - 1)}, "momentum_starts": {0: 1}}
    )
    model.register_comm_hook(state, sign_vote_hook)
    x, y = batch(rank, 0)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    except ValueError as error:
        return str(error)
    return None


def test_a_flat_hook_refuses_a_slice_of_the_node_aware_momentum():
    for message in run_distributed(_slice_into_flat_worker, 2):
        assert message is not None and "a slice saved by the node-aware vote" in message, message


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes_on_one_machine_runs_the_benchmark():
    """Two torchrun launchers joined by c10d rendezvous, as two nodes of two ranks."""
    port = _free_port()
    root = Path(__file__).resolve().parent.parent
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "nodes",
        "-m",
        "signmuon.benchmarks",
        "ddp-step",
        "--methods",
        "signsgd_mv",
        "signsgd_mv_node",
        "--width",
        "64",
        "--depth",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in launchers]
    assert all(p.returncode == 0 for p in launchers), outputs
    table = "\n".join(outputs)
    assert "signsgd_mv_node" in table and "nodes=2x2" in table, table


def test_config_fields_validate_and_come_from_a_deepspeed_vote_section():
    config = VoteConfig.from_dict({"hierarchical": True, "ranks_per_node": 8})
    assert config.hierarchical and config.ranks_per_node == 8
    assert config.settings()["hierarchical"] is True
    with pytest.raises(ValueError, match="only used with hierarchical=True"):
        VoteConfig(ranks_per_node=2)
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        VoteConfig(hierarchical=True, ranks_per_node=0)


def test_owners_balance_cost_and_are_deterministic():
    from signmuon.optim.newton_schulz import assign_owners as owners

    costs = [100.0, 60.0, 50.0, 10.0, 10.0]
    assert owners(costs, 2) == [0, 1, 1, 0, 0] == owners(list(costs), 2)
    loads = [sum(c for c, o in zip(costs, owners(costs, 2)) if o == r) for r in range(2)]
    assert max(loads) - min(loads) <= max(costs) and owners(costs, 1) == [0] * 5
