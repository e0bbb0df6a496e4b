"""DPPF averager and Inverse Mean Valley on real gloo processes."""

import math
import statistics

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from signmuon.optim import LocalStepAverager, inverse_mean_valley
from tests.harness import run_distributed


def _rank_model(rank: int) -> nn.Module:
    torch.manual_seed(100 + rank)  # different parameters on every rank
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].running_mean.fill_(float(rank))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # torch's averagers only average parameters with a gradient
    return model


def _round_worker(rank, world_size, pull, push, distance):
    model = _rank_model(rank)
    before = [p.detach().clone() for p in model.parameters()]
    averager = LocalStepAverager(period=3, warmup_steps=2, pull=pull, push=push, distance=distance, module=model)
    for _ in range(2):  # warm-up steps: nothing happens
        averager.average_parameters(model.parameters())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    averager.average_parameters(model.parameters())  # step 2: a round
    after = [p.detach().clone() for p in model.parameters()]
    averager.average_parameters(model.parameters())  # step 3: no round
    state = averager.state_dict()
    restored = LocalStepAverager(period=3, warmup_steps=2, pull=pull, push=push, distance=distance)
    restored.load_state_dict(state)
    return dict(
        before=before,
        after=after,
        unchanged=unchanged,
        running_mean=model[1].running_mean.clone(),
        rounds=averager.rounds,
        mean_distance=averager.mean_distance,
        max_distance=averager.max_distance,
        bytes=averager.stats.bytes_sent,
        restored=(restored.step, restored.rounds),
        state=state,
        moved_after=torch.equal(after[0], model[0].weight),
    )


@pytest.mark.parametrize("distance", ["model", "tensor"])
def test_one_round_equals_the_formula(distance):
    pull, push, world_size = 0.3, 0.05, 3
    results = run_distributed(_round_worker, world_size, pull, push, distance)
    n_params = len(results[0]["before"])
    means = [torch.stack([r["before"][i] for r in results]).mean(dim=0) for i in range(n_params)]
    radii = []
    for r in results:
        assert r["unchanged"], "no round may run during warm-up"
        diffs = [x - m for x, m in zip(r["before"], means)]
        model_r = math.sqrt(sum(float(d.pow(2).sum()) for d in diffs))
        radii.append(model_r)
        for x, d, got in zip(r["before"], diffs, r["after"]):
            scale = model_r if distance == "model" else float(d.norm())
            expected = x - pull * d + push * d / max(scale, 1e-8)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert r["moved_after"], "step 3 is not a round"
        # Buffers: plain mean of the ranks' running means (0, 1, 2).
        assert torch.allclose(r["running_mean"], torch.full((4,), 1.0))
        assert r["rounds"] == 1 and r["restored"] == (4, 1)
    if distance == "model":
        assert results[0]["mean_distance"] == pytest.approx(statistics.mean(radii), rel=1e-5)
        assert results[0]["max_distance"] == pytest.approx(max(radii), rel=1e-5)
    numel = sum(p.numel() for p in results[0]["before"])
    ring = 2 * (world_size - 1) * numel * 4 // world_size
    assert results[0]["bytes"] >= ring


def _periodic_worker(rank, world_size, use_dppf):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = (
        LocalStepAverager(period=2, warmup_steps=1, pull=1.0, push=0.0) if use_dppf else PeriodicModelAverager(2, 1)
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=gen)).pow(2).mean().backward()
        opt.step()
        averager.average_parameters(model.parameters())
    return [p.detach().clone() for p in model.parameters()]


def test_pull_one_push_zero_is_periodic_model_averager_bit_for_bit():
    ours = run_distributed(_periodic_worker, 3, True)
    torchs = run_distributed(_periodic_worker, 3, False)
    for rank in range(3):
        for a, b in zip(ours[rank], torchs[rank]):
            assert torch.equal(a, b)


PULL_PUSH = [(0.5, 0.02), (0.5, 0.1), (0.2, 0.04), (0.8, 0.08)]


def _quadratic_worker(rank, world_size, rounds):
    return [_quadratic_run(rank, pull, push, rounds) for pull, push in PULL_PUSH]


def _quadratic_run(rank, pull, push, rounds):
    x = torch.nn.Parameter(torch.ones(50))
    x.grad = torch.zeros(50)
    gen = torch.Generator().manual_seed(rank + 1)
    averager = LocalStepAverager(period=4, pull=pull, push=push)
    opt = torch.optim.SGD([x], lr=0.01)
    distances = []
    for _ in range(4 * rounds):
        x.grad = 0.1 * x.detach() + 0.1 * torch.randn(50, generator=gen)  # flat quadratic, noisy gradient
        opt.step()
        was_round = averager.is_round()
        averager.average_parameters([x])
        if was_round:
            distances.append(averager.mean_distance)
    return distances


def test_worker_distance_settles_near_push_over_pull():
    for (pull, push), distances in zip(PULL_PUSH, run_distributed(_quadratic_worker, 4, 120)[0]):
        settled = statistics.mean(distances[-30:])
        # Between rounds the quadratic contracts the spread a little (lr*h*period = 0.004), so the
        # fixed point sits just under push/pull; 15% covers that and the noise.
        assert settled == pytest.approx(push / pull, rel=0.15), (pull, push)
        assert max(distances[-30:]) < 1.5 * push / pull, ("stable: no drift away", pull, push)


class _Quadratic(nn.Module):
    """Loss 0.5 * curvature * (w - w0)^2 in one parameter: valley half-width sqrt(2*delta/curvature)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x):
        return self.w.expand(len(x))


@pytest.mark.parametrize("curvature", [0.5, 2.0, 8.0])
def test_inverse_mean_valley_on_quadratic(curvature):
    model = _Quadratic()
    model.train()
    batches = [(torch.zeros(1), torch.zeros(1))]
    loss_fn = lambda out, y: 0.5 * curvature * (out - y).pow(2).mean()  # noqa: E731
    result = inverse_mean_valley(model, loss_fn, batches, directions=4, delta=0.1, max_distance=10.0, seed=1)
    analytic = math.sqrt(2 * 0.1 / curvature)
    assert result.distances == pytest.approx([analytic] * 4, rel=1e-6)
    assert result.inverse_mean_valley == pytest.approx(1 / analytic, rel=1e-6)
    assert result.capped == 0
    assert model.training and model.w.item() == 0.0, "model restored"


def test_sharper_quadratic_has_larger_inverse_mean_valley():
    batches = [(torch.zeros(1), torch.zeros(1))]
    values = []
    for curvature in (0.5, 2.0, 8.0):
        loss_fn = lambda out, y, c=curvature: 0.5 * c * (out - y).pow(2).mean()  # noqa: E731
        values.append(inverse_mean_valley(_Quadratic(), loss_fn, batches, directions=2, seed=0).inverse_mean_valley)
    assert values[0] < values[1] < values[2]


def test_inverse_mean_valley_properties():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,)))]
    before = [p.detach().clone() for p in net.parameters()]
    kwargs = dict(directions=3, delta=0.05, max_distance=20.0)
    a = inverse_mean_valley(net, nn.functional.cross_entropy, batches, seed=7, **kwargs)
    b = inverse_mean_valley(net, nn.functional.cross_entropy, batches, seed=7, **kwargs)
    c = inverse_mean_valley(net, nn.functional.cross_entropy, batches, seed=8, **kwargs)
    assert a == b, "deterministic for a seed"
    assert a.distances != c.distances
    assert all(torch.equal(x, y) for x, y in zip(before, net.parameters())), "restored exactly"
    filtered = inverse_mean_valley(net, nn.functional.cross_entropy, batches, seed=7, filter_normalized=True, **kwargs)
    assert filtered.mean_valley > 0


def _bad_worker(rank, world_size):
    errors = []
    for kwargs in [
        dict(period=0),
        dict(period=2.5),
        dict(period=2, warmup_steps=-1),
        dict(period=2, pull=-0.1),
        dict(period=2, pull=1.5),
        dict(period=2, push=-1.0),
        dict(period=2, eps=0.0),
        dict(period=2, distance="layer"),
    ]:
        try:
            LocalStepAverager(**kwargs)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_bad_settings():
    errors = run_distributed(_bad_worker, 1)[0]
    names = ["period", "period", "warmup_steps", "pull", "pull", "push", "eps", "distance"]
    for name, error in zip(names, errors):
        assert error is not None and name in error, (name, error)
    with pytest.raises(ValueError, match="directions"):
        inverse_mean_valley(_Quadratic(), lambda o, y: o.sum(), [(torch.zeros(1), torch.zeros(1))], directions=0)
    with pytest.raises(ValueError, match="empty"):
        inverse_mean_valley(_Quadratic(), lambda o, y: o.sum(), [])


def _old_name_worker(rank, world_size):
    import warnings

    from signmuon.optim import DPPFAverager

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = DPPFAverager(period=4, pull=0.25, push=0.1)
    new = LocalStepAverager(period=4, pull=0.25, push=0.1)
    same = repr(old.state_dict()) == repr(new.state_dict())  # repr: the NaN distances compare equal
    return isinstance(old, LocalStepAverager), same, [(w.category.__name__, str(w.message)) for w in caught]


def test_the_old_name_warns_and_is_the_same_averager():
    """DPPFAverager works for one release (0.2): the same class, with a DeprecationWarning naming the new one."""
    is_engine, same, caught = run_distributed(_old_name_worker, 2)[0]
    assert is_engine and same
    assert [c for c, _ in caught] == ["DeprecationWarning"] and "LocalStepAverager" in caught[0][1]
