"""SignMuon: DDP hook + step against a single-process simulation of the M workers, the
single-process optimizer against the math written out, checkpoints, convergence, bad input."""

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import SignVoteState, VoteConfig, sign_muon_hook
from signmuon.optim import SignMuon, as_matrix, newton_schulz, polar_direction
from tests.harness import run_distributed, vote_reference

# The simulation votes the literal sign(sum sign): ties 0 (the default tie rule is a coin).
EXACT = VoteConfig(tie="exact")

STEPS = 3
CONFIGS = {
    # DDP hook; biases on the Signum vote; decoupled decay; Nesterov.
    "hook_signum": dict(
        ddp=True,
        bucket_cap_mb=25,
        opt=dict(
            lr=0.01,
            momentum=0.9,
            nesterov=True,
            weight_decay=0.1,
            polar_after_vote=False,
            non_matrix="signum",
            vote=EXACT,
        ),
    ),
    # DDP hook, many buckets (some mixing voted and averaged tensors), post-vote polar step,
    # biases on AdamW over an all-reduce, coupled decay, no Nesterov.
    "hook_polar_adamw": dict(
        ddp=True,
        bucket_cap_mb=0.001,
        opt=dict(
            lr=0.01,
            momentum=0.8,
            nesterov=False,
            coupled_weight_decay=0.05,
            polar_after_vote=True,
            non_matrix="adamw",
            adamw_lr=0.003,
            vote=EXACT,
        ),
    ),
    # No DDP: step() votes across the group itself.
    "vote_in_step": dict(
        ddp=False,
        bucket_cap_mb=None,
        opt=dict(
            lr=0.01,
            momentum=0.9,
            nesterov=True,
            polar_after_vote=True,
            non_matrix="signum",
            vote_in_step=True,
            vote=EXACT,
        ),
    ),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 1, 6, 6, generator=gen), torch.randint(0, 5, (6,), generator=gen)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def _train(rank, world_size, cfg, steps, start=0, load=None, save=None):
    net = _model()
    opt = SignMuon(net.parameters(), **cfg["opt"])
    model = net
    if cfg["ddp"]:
        model = DDP(net, bucket_cap_mb=cfg["bucket_cap_mb"])
        opt.register_comm_hook(model)
    if load:
        saved = torch.load(f"{load}.rank{rank}", weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    history = []
    for step in range(start, start + steps):
        history.append([p.detach().clone() for p in net.parameters()])
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        opt.step()
    if save:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, f"{save}.rank{rank}")
    history.append([p.detach().clone() for p in net.parameters()])
    return history


def _configs_worker(rank, world_size):
    return {name: _train(rank, world_size, cfg, STEPS) for name, cfg in CONFIGS.items()}


def _simulate_step(sim, params, step, world_size, cfg, momenta, adamw):
    """Parameters after one SignMuon step of M simulated workers, from ``params``."""
    o = {"nesterov": True, "weight_decay": 0.0, "coupled_weight_decay": 0.0, "adamw_lr": None, **cfg["opt"]}
    with torch.no_grad():
        for p, value in zip(sim.parameters(), params):
            p.copy_(value)
    grads = []
    for r in range(world_size):
        sim.zero_grad(set_to_none=True)
        _loss(sim, r, step).backward()
        grads.append([p.grad.clone() for p in sim.parameters()])
    expected = []
    for i, p in enumerate(sim.parameters()):
        local = [g[i] for g in grads]
        if p.dim() < 2 and o["non_matrix"] == "adamw":
            p.grad = torch.stack(local).mean(dim=0)
            adamw[i].step()  # torch.optim.AdamW on the mean gradient
            expected.append(p.detach().clone())
            continue
        directions = []
        for r in range(world_size):
            g = local[r] + o["coupled_weight_decay"] * params[i]
            m = momenta[r][i]
            m.mul_(o["momentum"]).add_(g, alpha=1 - o["momentum"])
            d = o["momentum"] * m + (1 - o["momentum"]) * g if o["nesterov"] else m.clone()
            if p.dim() >= 2:
                d = newton_schulz(as_matrix(d)).view_as(p)
            directions.append(d.reshape(-1))
        S = vote_reference(torch.stack(directions)).view_as(p)
        D = S
        if p.dim() >= 2 and o["polar_after_vote"]:
            D = newton_schulz(as_matrix(S)).view_as(p)
            D = D / (D.norm() / math.sqrt(D.numel()))
        expected.append(params[i] * (1 - o["lr"] * o["weight_decay"]) - o["lr"] * D)
    return expected


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_signmuon_matches_simulation_of_workers(world_size):
    per_rank = run_distributed(_configs_worker, world_size)
    sim = _model()
    for name, cfg in CONFIGS.items():
        momenta = [[torch.zeros_like(p) for p in sim.parameters()] for _ in range(world_size)]
        lr_a = cfg["opt"].get("adamw_lr") or cfg["opt"]["lr"]
        adamw = {
            i: torch.optim.AdamW([p], lr=lr_a, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
            for i, p in enumerate(sim.parameters())
        }
        history = per_rank[0][name]
        for step in range(STEPS):
            expected = _simulate_step(sim, history[step], step, world_size, cfg, momenta, adamw)
            for i, (got, want) in enumerate(zip(history[step + 1], expected)):
                # Float tolerance only: the signs and votes are identical, the all-reduced AdamW
                # gradients sum in a different order.
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} step {step} param {i}")
            assert not torch.equal(history[step + 1][0], history[step][0]), "the step moved nothing"
        for r in range(1, world_size):
            for a, b in zip(per_rank[0][name][-1], per_rank[r][name][-1]):
                assert torch.equal(a, b), f"{name}: rank {r} diverged"


def test_single_process_equals_written_out_math():
    sim = _model()
    cfg = {
        "opt": dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05, polar_after_vote=True, non_matrix="signum")
    }
    model = _model()
    opt = SignMuon(model.parameters(), **cfg["opt"])
    momenta = [[torch.zeros_like(p) for p in sim.parameters()]]
    for step in range(4):
        params = [p.detach().clone() for p in model.parameters()]
        expected = _simulate_step(sim, params, step, 1, cfg, momenta, adamw={})
        opt.zero_grad()
        _loss(model, 0, step).backward()
        opt.step()
        for got, want in zip(model.parameters(), expected):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_direction_keeps_a_bad_gradient_visible_without_reading_it_on_the_host(bad, nesterov, monkeypatch):
    from signmuon.optim import signum_direction

    gen = torch.Generator().manual_seed(0)
    grad, momentum = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    before = momentum.clone()
    direction = signum_direction(grad, momentum, 0.9, nesterov=nesterov)
    advanced = before.lerp(grad, 0.1)
    assert torch.equal(momentum, advanced)
    assert torch.equal(direction, grad.lerp(advanced, 0.9) if nesterov else advanced)
    grad[2, 3], momentum = bad, before.clone()
    direction = signum_direction(grad, momentum, 0.9, nesterov=nesterov)
    assert torch.equal(momentum, before), "a non-finite gradient entered the momentum"
    assert not torch.isfinite(direction[2, 3]), "the vote would not see the bad gradient"
    # Where a host read would stall a GPU, none happens: meta tensors fail any read of a value.
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("read a flag on the host"))
    meta = torch.empty(5, 7, device="meta")
    assert signum_direction(meta, meta.clone(), 0.9, nesterov=nesterov).shape == (5, 7)


def test_post_vote_polar_step_band_and_rms():
    gen = torch.Generator().manual_seed(0)
    ns = (5, (3.4445, -4.7750, 2.0315), torch.float32)  # steps, coefficients, dtype
    for shape in [(64, 64), (32, 96), (16, 2, 3, 3)]:
        S = torch.randint(-1, 2, shape, generator=gen).float()
        D = polar_direction(S.clone(), *ns)
        assert D.shape == S.shape
        assert abs(D.pow(2).mean().sqrt().item() - 1.0) < 1e-5
        s = torch.linalg.svdvals(as_matrix(D))
        # Entry-RMS 1 fixes ||D||_F = sqrt(m*n), so the band is relative to its mean singular value.
        mean = s.pow(2).mean().sqrt()
        assert 0.5 < (s / mean).min() and (s / mean).max() < 1.5
    zero = polar_direction(torch.zeros(8, 8), *ns)
    assert torch.equal(zero, torch.zeros(8, 8))


def test_state_is_eager_and_round_trips():
    model = _model()
    opt = SignMuon(model.parameters(), lr=0.01, non_matrix="adamw")
    state = opt.state_dict()
    keys = [sorted(s) for s in state["state"].values()]
    assert keys.count(["momentum_buffer"]) == 3 and keys.count(["exp_avg", "exp_avg_sq", "step"]) == 3
    for step in range(2):
        opt.zero_grad()
        _loss(model, 0, step).backward()
        opt.step()
    saved = opt.state_dict()
    other = SignMuon(_model().parameters(), lr=0.01, non_matrix="adamw")
    other.load_state_dict(saved)
    assert other.steps_taken == 2
    for a, b in zip(opt.state.values(), other.state.values()):
        for k in a:
            assert torch.equal(a[k], b[k])


def test_checkpoint_resume_in_fresh_processes(tmp_path):
    cfg = CONFIGS["hook_polar_adamw"]
    whole = run_distributed(_train_worker, 2, cfg, 4, 0, None, None)
    run_distributed(_train_worker, 2, cfg, 2, 0, None, str(tmp_path / "ckpt"))
    resumed = run_distributed(_train_worker, 2, cfg, 2, 2, str(tmp_path / "ckpt"), None)
    for r in range(2):
        for a, b in zip(whole[r][-1], resumed[r][-1]):
            assert torch.equal(a, b), "the resumed run differs from the uninterrupted one"


def _train_worker(rank, world_size, cfg, steps, start, load, save):
    return _train(rank, world_size, cfg, steps, start=start, load=load, save=save)


def _misuse_worker(rank, world_size):
    errors = {}

    def capture(name, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - the test inspects the message
            errors[name] = f"{type(error).__name__}: {error}"

    net = _model()
    opt = SignMuon(net.parameters(), lr=0.01)

    def step_without_hook():
        _loss(net, rank, 0).backward()
        opt.step()

    capture("no_hook", step_without_hook)
    model = DDP(_model())
    opt = SignMuon(model.parameters(), lr=0.01)
    opt.register_comm_hook(model)
    capture("no_backward", opt.step)

    def two_synced_backwards():
        _loss(model, rank, 0).backward()
        _loss(model, rank, 1).backward()
        opt.step()

    capture("twice", two_synced_backwards)
    wrong = DDP(_model())
    wrong.register_comm_hook(SignVoteState(), sign_muon_hook)
    capture("wrong_state", lambda: _loss(wrong, rank, 0).backward())
    return errors


def test_misuse_is_caught():
    errors = run_distributed(_misuse_worker, 2)[0]
    assert "communication hook" in errors["no_hook"] and errors["no_hook"].startswith("RuntimeError")
    assert "has not run" in errors["no_backward"]
    assert "ran 2 times" in errors["twice"] and "no_sync" in errors["twice"]
    assert "SignMuonHookState" in errors["wrong_state"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=-0.1), "momentum"),
        (dict(momentum=1.0), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(non_matrix="sgd"), "non_matrix"),
        (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SignMuon(_model().parameters(), **kwargs)


def test_matrix_flag_on_vector_names_the_parameter():
    model = _model()
    with pytest.raises(ValueError, match=r"0\.bias.*matrix path"):
        SignMuon(
            [
                {
                    "params": [p for n, p in model.named_parameters() if n == "0.bias"],
                    "param_names": ["0.bias"],
                    "use_muon": True,
                }
            ],
            lr=0.01,
        )
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 \(shape \(4,\)\)"):
        SignMuon([{"params": [model[0].bias], "use_muon": True}], lr=0.01)
