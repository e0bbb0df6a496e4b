"""BackwardReducer (a DDP hook run without DDP, bucket by bucket in backward) against DDP itself,
and clipping-invariance of every optimizer that applies the vote (2 gloo ranks, one group)."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import BackwardReducer, SignVoteState, sign_vote_hook
from signmuon.optim import SignMuon, SignSGDMV, SignumMV
from tests.harness import run_distributed

from .harness import batch, tiny_net

STEPS = 4


class WithSideBranch(nn.Module):
    """tiny_net plus a branch only rank 0 uses (a parameter unused on the other ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_net()
        self.side = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.side(x) if use_side else out


def _train(rank, model, step_fn, opt, clip=None):
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(step_fn(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _reduced_like_ddp(rank):
    """Signum-MV hook under DDP (find_unused_parameters) and under BackwardReducer with
    buckets of one or two parameters: the same parameters, step for step."""
    runs = {}
    for mode in ("ddp", "reducer"):
        torch.manual_seed(0)
        net = WithSideBranch()
        state = SignVoteState(momentum=0.9, start_iter=1)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        if mode == "ddp":
            model = DDP(net, find_unused_parameters=True)
            model.register_comm_hook(state, sign_vote_hook)
            forward = lambda x: model(x, rank == 0)  # noqa: E731
        else:
            reducer = BackwardReducer(
                net.parameters(), state, sign_vote_hook, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4
            )
            forward = lambda x: net(x, rank == 0)  # noqa: E731
        runs[mode] = _train(rank, net, forward, opt)
    return runs, len(reducer.buckets), reducer.backward_passes, state.stats.calls


def _clipping(rank):
    """Each optimizer applying the vote, k steps with clip_grad_norm_(0.01) and without; the bare
    hook with SGD for contrast (clipping shrinks its step)."""
    results = {}
    for name, make in {
        "SignMuon": lambda ps: SignMuon(ps, lr=0.02, polar_after_vote=True),
        "SignumMV": lambda ps: SignumMV(ps, lr=0.02, momentum=0.9),
        "SignSGDMV": lambda ps: SignSGDMV(ps, lr=0.02),
        "hook+SGD": None,
    }.items():
        runs = []
        for clip in (None, 0.01):
            net = tiny_net()
            model = DDP(net)
            if make is None:
                opt = torch.optim.SGD(net.parameters(), lr=0.02)
                model.register_comm_hook(SignVoteState(momentum=0.0, start_iter=0), sign_vote_hook)
            else:
                opt = make(net.parameters())
                opt.register_comm_hook(model)
            runs.append(_train(rank, net, model, opt, clip))
        results[name] = runs
    return results


def _both(rank, world_size):
    return _reduced_like_ddp(rank), _clipping(rank)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_both, 2, timeout=300)


def test_backward_reducer_votes_as_ddp(results):
    for rank, ((runs, buckets, passes, calls), _) in enumerate(results):
        assert buckets > 2, "several buckets, handed over in order"
        assert passes == STEPS and calls >= STEPS * buckets
        for step in range(STEPS):
            for a, b in zip(runs["ddp"][step], runs["reducer"][step]):
                assert torch.equal(a, b), f"rank {rank} step {step}"
    torch.manual_seed(0)
    side_before = WithSideBranch().side.weight
    assert not torch.equal(results[1][0][0]["reducer"][-1][-2], side_before), "the side branch trained (rank 0's votes)"
    for a, b in zip(results[0][0][0]["reducer"][-1], results[1][0][0]["reducer"][-1]):
        assert torch.equal(a, b), "replicas agree"


@pytest.mark.parametrize("name", ["SignMuon", "SignumMV", "SignSGDMV"])
def test_clipping_changes_nothing(results, name):
    for rank, (_, clipping) in enumerate(results):
        unclipped, clipped = clipping[name]
        assert not torch.equal(unclipped[0][0], unclipped[-1][0]), "it trains"
        for step in range(STEPS):
            for a, b in zip(unclipped[step], clipped[step]):
                assert torch.equal(a, b), f"{name} rank {rank} step {step}: clipping changed the update"


def test_clipping_shrinks_the_bare_hooks_sgd_step(results):
    """Why the docs steer users of the bare hook away from clipping: SGD applies the shrunk vote."""
    unclipped, clipped = results[0][1]["hook+SGD"]
    moved = lambda run: sum((a - b).abs().sum() for a, b in zip(run[-1], tiny_net().parameters()))  # noqa: E731
    assert moved(clipped) < 0.1 * moved(unclipped)


def test_the_exchange_is_chosen_once():
    """An optimizer votes through one exchange: the group is set before the hook is chosen, and a
    second entry point (or a group set after) raises instead of voting where no one listens."""
    opt = SignumMV(tiny_net().parameters(), lr=0.1)
    opt.register_backward_reducer()
    assert opt.has_comm_hook and type(opt.exchange).__name__ == "HookExchange"
    state = opt.comm_state
    assert opt.comm_state is state, "asking again gives the same hook"
    with pytest.raises(RuntimeError, match="before HookExchange"):
        opt.process_group = None
    with pytest.raises(RuntimeError, match="already votes through HookExchange"):
        opt.use_exchange(type(opt.exchange)(state))
