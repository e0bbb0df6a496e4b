"""What a Muon user relies on: sign-safe Newton–Schulz precision, per-layer step sizes
(``lr_scaling``), and routing embeddings / heads off the matrix path with each tensor once."""

import math
import warnings

import pytest
import torch
from torch import nn

from signmuon.optim import MUON_UPDATE_RMS, SignMuon, muon_param_groups, newton_schulz


def test_float32_newton_schulz_ignores_a_global_tf32_setting():
    x = torch.randn(64, 96, dtype=torch.float64)
    exact = newton_schulz(x.float())
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # what nanoGPT-style scripts switch on
    try:
        assert torch.equal(newton_schulz(x.float()), exact)
        assert torch.get_float32_matmul_precision() == "medium", "the caller's setting is restored"
    finally:
        torch.set_float32_matmul_precision(previous)


def _one_step(shape, lr_scaling, lr=0.01, seed=0):
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(shape, dtype=torch.float64))  # float64: the difference is exact
    before = w.detach().clone()
    opt = SignMuon([w], lr=lr, momentum=0.0, nesterov=False, lr_scaling=lr_scaling)
    w.grad = torch.randn(shape, dtype=torch.float64)
    opt.step()
    return (w.detach() - before).abs()


@pytest.mark.parametrize("shape", [(64, 64), (96, 384), (384, 96), (16, 3, 3, 3)])
def test_each_lr_scaling_gives_the_documented_step(shape):
    fan_in = math.prod(shape[1:])
    lr = 0.01
    for scaling, expected in [
        ("global", lr),
        ("fan_in", lr / math.sqrt(fan_in)),
        ("muon", lr * MUON_UPDATE_RMS / math.sqrt(fan_in)),
    ]:
        moved = _one_step(shape, scaling, lr)
        torch.testing.assert_close(moved, torch.full_like(moved, expected), rtol=1e-9, atol=0)


@pytest.mark.parametrize("shape", [(64, 64), (96, 384), (384, 96)])
def test_muon_scaling_matches_torch_muons_update_rms(shape):
    """A Muon user keeps their lr: torch.optim.Muon's per-layer update RMS, within 10%."""
    lr = 0.02
    rms = []
    for seed in range(3):
        torch.manual_seed(seed)
        w = nn.Parameter(torch.randn(shape))
        before = w.detach().clone()
        opt = torch.optim.Muon([w], lr=lr, weight_decay=0.0)
        w.grad = torch.randn(shape)
        opt.step()
        rms.append((w.detach() - before).pow(2).mean().sqrt().item())
    ours = _one_step(shape, "muon", lr).pow(2).mean().sqrt().item()
    assert ours == pytest.approx(sum(rms) / len(rms), rel=0.10)


def test_lr_scaling_and_ns_dtype_are_validated():
    w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="lr_scaling"):
        SignMuon([w], lr_scaling="per_layer")
    with pytest.raises(ValueError, match="ns_dtype"):
        SignMuon([w], ns_dtype="float16")


class TiedGPT(nn.Module):
    """nanoGPT's layout in miniature: the head shares the token embedding's weight."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(8, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2))


@pytest.mark.parametrize("make", [TiedGPT, _gpt2], ids=["nanogpt-style", "hf-gpt2"])
def test_routing_puts_each_tensor_once_and_embeddings_and_head_off_the_matrix_path(make):
    if make is _gpt2:
        pytest.importorskip("transformers")
    model = make()
    groups = muon_param_groups(model, lr=0.01)
    listed = [p for g in groups for p in g["params"]]
    assert len({id(p) for p in listed}) == len(listed), "each tensor once"
    assert {id(p) for p in listed} == {id(p) for p in model.parameters()}, "every trainable tensor"
    matrix = next(g for g in groups if g["use_muon"])
    other = next(g for g in groups if not g["use_muon"])
    assert matrix["lr"] == 0.01 and "lr" not in other
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    head = model.lm_head.weight
    assert all(any(e is p for p in other["params"]) for e in embeddings + [head])
    assert all(p.dim() >= 2 for p in matrix["params"]) and len(matrix["params"]) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about a tensor listed twice
        opt = SignMuon(groups)
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in groups]


def test_muon_baseline_takes_routed_groups_of_a_conv_net():
    """torch.optim.Muon takes 2-D parameters only: routed conv kernels go to AdamW, the hidden
    linear layer to Muon, the head to AdamW."""
    from signmuon.optim import MuonWithAdamW

    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 32), nn.ReLU())
    net.add_module("head", nn.Linear(32, 10))
    opt = MuonWithAdamW(muon_param_groups(net))
    muon, adamw = opt.optimizers
    assert [tuple(p.shape) for g in muon.param_groups for p in g["params"]] == [(32, 144)]
    assert (
        sum(p.numel() for g in adamw.param_groups for p in g["params"])
        == sum(p.numel() for p in net.parameters()) - 32 * 144
    )
    loss = net(torch.randn(2, 1, 8, 8)).sum()
    loss.backward()
    opt.step()
