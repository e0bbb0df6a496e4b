"""Every collective's tensors on its group's device, and at most two host reads per bucket and per
step, checked on a CPU build (``tests/gpu_world.py``: an accelerator without data, a fake process
group of 4 ranks, collectives checked, host reads counted)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from signmuon.comm_hooks import NodeLayout, SignVoteState, VoteConfig, node_layout, sign_muon_hook, sign_vote_hook
from signmuon.comm_hooks.dist import CommStats, group_device
from signmuon.comm_hooks.shard_vote import ShardSpec, ShardVoter
from signmuon.optim import LocalStepAverager, OuterStep, SignMuon, SignSGDMV, SignumMV

from .gpu_world import gpu_world, on_device
from .harness import run_distributed


class Bucket:
    """What a DDP hook reads of a ``GradBucket``: the flat buffer and its parameters' views."""

    def __init__(self, params: list[torch.Tensor], index: int = 0, last: bool = True) -> None:
        self.params, self._index, self._last = params, index, last
        self.flat = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return [g.view_as(p) for g, p in zip(torch.split(self.flat, [p.numel() for p in self.params]), self.params)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def deep_mlp(depth: int) -> nn.Module:
    layers = [nn.Linear(16, 32), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(32, 4))


def _with_grads(model: nn.Module) -> list[torch.Tensor]:
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _hook_reads(world, state, hook, iterations: int = 4) -> list[int]:
    """Host reads of each iteration's one bucket (the hook called as DDP calls it)."""
    params = _with_grads(on_device(mlp, world.device))
    reads = []
    for _ in range(iterations):
        world.reads.reset()
        hook(state, Bucket(params)).wait()
        reads.append(world.reads.total)
    return reads


# -- the group's device ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, expected",
    [
        ("nccl", "cuda:3"),
        ("cpu:gloo,cuda:nccl", "cuda:3"),
        ("gloo", "cpu"),
        ("cpu:gloo", "cpu"),
        ("cpu:gloo,cuda:gloo", "cpu"),
        ("torchft-nccl", "cuda:3"),
        ("meta:fake", "meta"),
    ],
)
def test_the_group_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert group_device(None) == torch.device(expected)


# -- every collective on the group's device ----------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_flat_vote_hook_keeps_its_collectives_on_the_device_and_reads_once_per_bucket(momentum):
    with gpu_world(4) as world:
        state = SignVoteState(None, momentum=momentum, start_iter=1)
        reads = _hook_reads(world, state, sign_vote_hook)
        assert not world.misplaced, world.misplaced
    # Warm-up: the settings digest and the iteration agreement (two reads each: a row built from
    # host data, its result); the first vote still agrees on the iteration; from then on the
    # first exchange's headers alone (no zeros, fast ties: the second exchange's are not read).
    assert reads[2:] == [1, 1], (reads, world.reads)
    assert max(reads[:2]) <= 5


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_node_aware_vote_hook_keeps_its_collectives_on_the_device(momentum):
    with gpu_world(4) as world:
        state = SignVoteState(
            None, momentum=momentum, start_iter=1, vote=VoteConfig(hierarchical=True, ranks_per_node=2)
        )
        _hook_reads(world, state, sign_vote_hook)
        assert not world.misplaced, world.misplaced


@pytest.mark.parametrize("hierarchical", [False, True])
def test_the_sign_muon_hook_keeps_its_collectives_on_the_device(hierarchical):
    with gpu_world(4) as world:
        model = on_device(mlp, world.device)
        vote = VoteConfig(hierarchical=True, ranks_per_node=2) if hierarchical else VoteConfig()
        opt = SignMuon(model.parameters(), lr=0.01, vote=vote)
        state = opt.comm_state
        params = _with_grads(model)
        reads = []
        for _ in range(4):
            world.reads.reset()
            sign_muon_hook(state, Bucket(params)).wait()
            reads.append(world.reads.total)
            opt.step()
        assert not world.misplaced, world.misplaced
    if not hierarchical:
        assert reads[2:] == [1, 1], (reads, world.reads)


@pytest.mark.parametrize("optimizer", [SignumMV, SignSGDMV, SignMuon])
@pytest.mark.parametrize("depth", [1, 10])
def test_a_step_that_votes_itself_keeps_its_collectives_on_the_device_and_reads_twice(optimizer, depth):
    """Whatever the parameter count (6 or 24 here): which parameters have a gradient somewhere,
    read once, and the vote's headers."""
    with gpu_world(4) as world:
        model = on_device(functools.partial(deep_mlp, depth), world.device)
        kwargs = {} if optimizer is SignSGDMV else {"momentum": 0.9}
        opt = optimizer(model.parameters(), lr=0.01, vote_in_step=True, **kwargs)
        reads = []
        for _ in range(3):
            _with_grads(model)
            world.reads.reset()
            opt.step()
            reads.append(world.reads.total)
        assert not world.misplaced, world.misplaced
    assert reads[1:] == [2, 2], (reads, world.reads)


@pytest.mark.parametrize("owner", [None, 0], ids=["elementwise", "owned"])
def test_the_fsdp_voter_reads_twice_per_step(owner):
    """The node's NaN flags (one read, which decides whose momentum moves) and the vote's headers."""
    with gpu_world(4, rank=1) as world:
        voter = ShardVoter(node_layout(None, 2), VoteConfig(), CommStats())
        specs = [
            ShardSpec((32, 16), key=0, owner=owner),
            ShardSpec((32,), key=1),
            ShardSpec((4, 32), key=2, owner=owner),
        ]
        shards = [
            torch.randn(16, 16, device=world.device),
            torch.randn(16, device=world.device),
            torch.randn(2, 32, device=world.device),
        ]
        reads = []
        for step in range(3):
            world.reads.reset()
            voter.vote(shards, specs, lambda i, g: g, lambda i, t: t, None, step=step, label="test")
            reads.append(world.reads.total)
        assert not world.misplaced, world.misplaced
    assert reads == [2, 2, 2], (reads, world.reads)


def test_the_voters_settle_reads_once_and_raises_what_a_rail_deferred():
    """The node's agreement on deferred mismatches (FSDP2's, after each backward): its word goes
    up without a stall and comes back in one read; a mismatch kept by ``deferring`` raises there."""
    from signmuon.comm_hooks import VoteMismatchError

    with gpu_world(4, rank=1) as world:
        voter = ShardVoter(node_layout(None, 2), VoteConfig(), CommStats(), defer_mismatch=True)
        world.reads.reset()
        voter.settle()
        assert world.reads.total == 1, world.reads
        with voter.deferring():
            raise VoteMismatchError("rail 1 at another step")
        with pytest.raises(VoteMismatchError, match="rail 1 at another step. hint"):
            voter.settle(". hint")
        voter.settle()  # raised once, then forgotten
        assert not world.misplaced, world.misplaced


def test_the_fsdp_unit_vote_reads_the_host_on_its_worker_not_on_the_autograd_thread():
    """FSDP2's hooks (run by backward) only queue a unit's vote; its two reads per call happen
    on the worker thread, and the autograd engine's final callback joins it."""
    import threading

    from signmuon.optim.fsdp_units import UnitVotes

    with gpu_world(4, rank=1) as world:
        voter = ShardVoter(node_layout(None, 2), VoteConfig(), CommStats())
        params = [nn.Parameter(torch.zeros(32, 16, device=world.device)) for _ in range(2)]
        for p in params:
            p.grad = torch.randn(32, 16, device=world.device)
        specs = [ShardSpec((32, 16), key=0), ShardSpec((32, 16), key=1)]
        release, threads = threading.Event(), []

        def vote(unit, params, grads):
            release.wait(timeout=60)
            threads.append(threading.current_thread())
            voter.vote([g[:16] for g in grads], specs, lambda i, g: g, lambda i, t: t, None, step=0, label="t")

        units = UnitVotes([params], 2, vote, world.device)
        x = torch.zeros((), device="cpu", requires_grad=True)

        def backward_hooks(grad):  # what FSDP2 calls inside backward: the unit's buffer, then each gradient
            units.reduced(0, 2 * 16 * 16)
            for p in params:
                units._accumulated(p)
            return grad

        x.register_hook(backward_hooks)
        world.reads.reset()
        worker = threading.Thread(target=lambda: (threading.Event().wait(0.5), release.set()))
        worker.start()
        (x * 2).backward()  # the final callback waits for the vote
        worker.join()
        assert threads and threads[0] is not threading.main_thread()
        assert world.reads.total == 2, world.reads  # the vote's two, none from the hooks
        assert units.running == [] and units.voted == {0}
        assert not world.misplaced, world.misplaced


def test_the_fsdp_vote_on_a_rank_without_shards_keeps_its_flags_on_the_device():
    """A rank that holds no shard of any tensor (rows that do not divide) still sends its flags
    on the group's device."""
    with gpu_world(4, rank=1) as world:
        layout = node_layout(None, 2)
        voter = ShardVoter(layout, VoteConfig(), CommStats())
        specs = [ShardSpec((1, 8), key=0)]  # one row: local rank 1 holds nothing
        voted = voter.vote([None], specs, lambda i, g: g, lambda i, t: t, None, step=0, label="test")
        assert voted[0].device == world.device
        assert not world.misplaced, world.misplaced


@pytest.mark.parametrize(
    "outer",
    [None, *(OuterStep.diloco(pseudo_gradient=rule) for rule in ("mean", "sign_vote", "sign_vote_ef", "scaled_sign"))],
    ids=["dppf", "mean", "sign_vote", "sign_vote_ef", "scaled_sign"],
)
def test_rounds_keep_their_collectives_on_the_device(outer):
    with gpu_world(4) as world:
        model = on_device(mlp, world.device)
        push = 0.1 if outer is None else 0.0
        averager = LocalStepAverager(period=1, pull=0.5, push=push, module=model, outer=outer)
        for _ in range(3):
            _with_grads(model)
            averager.average_parameters(model.parameters())
        assert not world.misplaced, world.misplaced


@pytest.mark.parametrize("rule", ["mean", "sign_vote"])
def test_the_first_outer_round_checks_its_start_on_the_device(rule):
    """The check that every rank starts from one consensus (first round, first after a load),
    called here directly: in this world every rank reads as if it had been checked already."""
    with gpu_world(4) as world:
        model = on_device(mlp, world.device)
        averager = LocalStepAverager(
            period=1, module=model, outer=OuterStep.diloco(pseudo_gradient=rule), track_distances=False
        )
        _with_grads(model)
        averager.average_parameters(model.parameters())
        averager.consensus.check_same_start(averager.stats)
        assert not world.misplaced, world.misplaced


def test_node_aware_rounds_keep_their_collectives_on_the_device():
    with gpu_world(4) as world:
        model = on_device(mlp, world.device)
        layout = node_layout(None, 2)
        assert isinstance(layout, NodeLayout)
        averager = LocalStepAverager(
            period=1, module=model, outer=OuterStep.diloco(pseudo_gradient="sign_vote"), layout=layout
        )
        for _ in range(2):
            _with_grads(model)
            averager.average_parameters(model.parameters())
        assert not world.misplaced, world.misplaced


def test_the_warm_up_all_reduce_reads_nothing_in_its_callback():
    with gpu_world(4) as world:
        state = SignVoteState(None, momentum=0.9, start_iter=10, vote=VoteConfig(nonfinite="skip"))
        params = _with_grads(on_device(mlp, world.device))
        sign_vote_hook(state, Bucket(params)).wait()  # settings and iteration agreed
        world.reads.reset()
        sign_vote_hook(state, Bucket(params)).wait()
        callback_reads = {site: n for site, n in world.reads.sites.items() if "allreduce.py" in site}
        assert world.reads.total <= 2 and not callback_reads, world.reads


# -- the group an optimizer votes over ----------------------------------------------------------


def _subgroup_vote_worker(rank: int, world_size: int) -> torch.Tensor:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    param = nn.Parameter(torch.zeros(64))
    opt = SignSGDMV([param], lr=1.0, vote_in_step=True)  # built for WORLD, as DeepSpeed builds it
    opt.process_group = pairs[rank // 2]  # then given the data-parallel group, as DeepSpeed's engine does
    gen = torch.Generator().manual_seed(100 + rank)
    param.grad = torch.randn(64, generator=gen)
    opt.step()
    return param.detach().clone()


def test_setting_the_process_group_moves_the_vote_in_step_there():
    """Ranks {0, 1} and {2, 3} vote apart (each pair's own majority), not over the world."""
    results = run_distributed(_subgroup_vote_worker, 4)
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(100 + r)) for r in range(4)]
    for pair in ((0, 1), (2, 3)):
        signs = sum(torch.sign(grads[r]) for r in pair)
        agreed = signs != 0  # where the pair ties, a coin decides: compare where it agrees
        for r in pair:
            assert torch.equal(results[r][agreed], -torch.sign(signs[agreed]))
    assert not torch.equal(results[0], results[2])


# -- host reads on a real run where zeros travel ------------------------------------------------


class Embedded(nn.Module):
    """An embedding whose rows of tokens absent from a batch get exact-zero gradients (zeros travel)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 16)
        self.body = mlp()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens).mean(dim=1))


def _embedding_reads_worker(rank: int, world_size: int, momentum: float) -> list[tuple[int, int, dict]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .gpu_world import counting_host_reads

    torch.manual_seed(0)
    model = DDP(Embedded(), bucket_cap_mb=0.005)  # several buckets
    state = SignVoteState(None, momentum=momentum, start_iter=1, vote=VoteConfig(kernels="torch"))
    calls = []

    def hook(state, bucket):
        calls.append(1)
        return sign_vote_hook(state, bucket)

    model.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(rank)
    per_iteration = []
    for _ in range(4):
        tokens = torch.randint(0, 512, (8, 4), generator=gen)  # 32 of 512 rows: most rows' gradients are 0
        calls.clear()
        model.zero_grad()  # a backward into gradients still holding the vote is refused
        with counting_host_reads() as reads:
            model(tokens).square().mean().backward()
        per_iteration.append((reads.total, len(calls), dict(reads.sites)))
    assert state.stats.bytes_sent > 0
    return per_iteration


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_vote_hook_reads_the_host_at_most_twice_per_bucket_where_zeros_travel(momentum):
    for per_iteration in run_distributed(_embedding_reads_worker, 4, momentum):
        for total, buckets, sites in per_iteration[2:]:  # voting, after the first vote
            assert buckets > 1 and total <= 2 * buckets, (total, buckets, sites)


def test_the_scaled_sign_allreduce_reads_only_its_agreement_and_headers():
    """DeepSpeed's compressed_allreduce (and one-bit rounds' "scaled_sign"): the sizes' agreement
    (callers' tensors are not equal by construction) and the scales, which travel in the headers,
    read once per exchange step; nothing else."""
    from signmuon.comm_hooks.vote import error_buffer_sizes, scaled_sign_allreduce

    with gpu_world(4) as world:
        worker, server = error_buffer_sizes(1000, 4)
        errors = torch.zeros(worker, device=world.device), torch.zeros(server, device=world.device)
        tensor = torch.randn(1000, device=world.device)
        scaled_sign_allreduce(tensor, *errors)  # warm
        world.reads.reset()
        scaled_sign_allreduce(tensor, *errors)
        assert not world.misplaced, world.misplaced
        assert world.reads.total == 3, world.reads


def test_fsdp_newton_schulz_sends_each_matrix_to_its_owner_alone():
    """A rank receives the float32 direction shards of the matrices it owns (1/L of them here),
    not every matrix; and gets back only its rows of the voted results."""
    L, matrices = 2, 8
    with gpu_world(4, rank=1) as world:
        voter = ShardVoter(node_layout(None, L), VoteConfig(), CommStats())
        specs = [ShardSpec((64, 32), key=k, owner=k % L) for k in range(matrices)]
        shards = [torch.randn(64 // L, 32, device=world.device) for _ in specs]
        world.collectives.clear()
        voted = voter.vote(shards, specs, lambda i, g: g, lambda i, t: t, lambda i, t: t, step=0, label="test")
        assert [tuple(v.shape) for v in voted] == [(32, 32)] * matrices
        assert not world.misplaced, world.misplaced
    float_in = [
        t for name, ts in world.collectives if name == "all_to_all_single" for t in ts[:1] if t.dtype == torch.float32
    ]
    entries = matrices * 64 * 32
    forward, back = float_in  # the directions to their owners, the polar results back
    assert forward.numel() * 4 <= (1 / L + 0.05) * 4 * entries, (forward.numel(), entries)
    assert back.numel() == entries // L  # this rank's rows of every matrix


def test_fsdp_owned_matrices_whose_rows_do_not_divide_come_back_as_this_ranks_rows():
    with gpu_world(4, rank=1) as world:  # local rank 1 of 2
        voter = ShardVoter(node_layout(None, 2), VoteConfig(), CommStats())
        specs = [
            ShardSpec((3, 16), key=0, owner=0),
            ShardSpec((1, 16), key=1, owner=1),
            ShardSpec((5, 4), key=2, owner=1),
        ]
        shards = [torch.randn(1, 16, device=world.device), None, torch.randn(2, 4, device=world.device)]
        voted = voter.vote(shards, specs, lambda i, g: g, lambda i, t: t, lambda i, t: t, step=0, label="test")
        assert [tuple(v.shape) for v in voted] == [(1, 16), (0, 16), (2, 4)]
        assert not world.misplaced, world.misplaced
