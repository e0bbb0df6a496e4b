"""Lightning, Accelerate and the HF Trainer with their real packages, 2 gloo ranks on CPU, tiny
models built in the test (nothing downloaded): hooks called, bytes counted, clipping changes
nothing, loss goes down, and the ways a framework drops a hook fail loudly."""

import os

import pytest
import torch
from torch import nn

from signmuon.benchmarks.launch import run_distributed

from .toys import capture

STEPS = 6


def _data(rank: int, n: int = 48) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 6, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


# -- Lightning ---------------------------------------------------------------------------------


def _lightning_fit(rank, make_optimizer, strategy, clip=None, steps=STEPS):
    import lightning.pytorch as pl

    from .toys import tiny_net

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_net()
            self.losses = []
            self.made = None

        def training_step(self, batch, _):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            self.made = make_optimizer(self.parameters())
            return self.made

    module = Net()
    loader = torch.utils.data.DataLoader(_data(0, 96), batch_size=8)  # Lightning shards it per rank
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_steps=steps, gradient_clip_val=clip,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    return module


def _lightning(rank, world_size):
    os.environ["NODE_RANK"] = "0"
    from signmuon.comm_hooks import SignVoteState
    from signmuon.integrations.lightning import SignDDPStrategy
    from signmuon.optim import DPPFAverager, SignMuon, SignumMV

    out = {}
    for name, make in {"SignMuon": lambda ps: SignMuon(ps, lr=0.02), "SignumMV": lambda ps: SignumMV(ps, lr=0.02)}.items():
        runs = [_lightning_fit(rank, make, SignDDPStrategy(), clip) for clip in (None, 0.01)]
        out[name] = dict(
            params=[[p.detach().clone() for p in m.parameters()] for m in runs],
            calls=runs[0].made.comm_state.stats.calls,
            losses=runs[0].losses,
        )
    state = SignVoteState(momentum=0.9)
    module = _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.02), SignDDPStrategy(comm_state=state))
    out["hook"] = dict(calls=state.stats.calls, sent=state.stats.bytes_sent, params=[p.detach().clone() for p in module.parameters()])
    out["hook_clip"] = capture(
        lambda: _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.02), SignDDPStrategy(comm_state=SignVoteState()), 1.0)
    )
    averager = DPPFAverager(period=2, pull=0.5, push=0.01)
    module = _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.05), SignDDPStrategy(averager=averager))
    out["dppf"] = dict(rounds=averager.rounds, sent=averager.stats.bytes_sent, params=[p.detach().clone() for p in module.parameters()])
    out["nothing"] = capture(lambda: _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.02), SignDDPStrategy()))
    return out


@pytest.fixture(scope="module")
def lightning_results():
    pytest.importorskip("lightning", reason="the lightning extra")  # installed by the test extra
    return run_distributed(_lightning, 2, timeout=400)


def test_lightning_strategy_registers_our_hooks_on_cpu(lightning_results):
    for out in lightning_results:
        for name in ("SignMuon", "SignumMV"):
            run = out[name]
            assert run["calls"] >= STEPS, f"{name}'s hook ran under Lightning on CPU"
            assert sum(run["losses"][-2:]) < sum(run["losses"][:2]), f"{name}: loss goes down {run['losses']}"
            unclipped, clipped = run["params"]
            for a, b in zip(unclipped, clipped):
                assert torch.equal(a, b), f"{name}: gradient_clip_val changed the update"
        assert out["hook"]["calls"] >= STEPS and out["hook"]["sent"] > 0
        assert "gradient_clip_val=1.0" in out["hook_clip"] and out["hook_clip"].startswith("ValueError")
        assert out["dppf"]["rounds"] == STEPS // 2 and out["dppf"]["sent"] > 0
        assert out["nothing"].startswith("ValueError") and "SGD" in out["nothing"]
    rank0, rank1 = lightning_results
    for first, second in [(rank0[n]["params"][0], rank1[n]["params"][0]) for n in ("SignMuon", "SignumMV")] + [
        (rank0["hook"]["params"], rank1["hook"]["params"])
    ]:
        for a, b in zip(first, second):
            assert torch.equal(a, b), "replicas agree"
    # DPPF: workers differ between rounds, never diverge (pull) and the last step was a round.
    assert any(not torch.equal(a, b) for a, b in zip(*(out["dppf"]["params"] for out in lightning_results)))


def test_lightning_strategy_refuses_lightnings_own_hook_arguments():
    pytest.importorskip("lightning", reason="the lightning extra")
    from signmuon.comm_hooks import SignVoteState, sign_vote_hook
    from signmuon.integrations.lightning import SignDDPStrategy

    with pytest.raises(ValueError, match="ddp_comm_hook"):
        SignDDPStrategy(ddp_comm_hook=sign_vote_hook, ddp_comm_state=SignVoteState())
    with pytest.raises(ValueError, match="model_averaging_period"):
        SignDDPStrategy(model_averaging_period=4)
    with pytest.raises(TypeError, match="SignVoteState"):
        SignDDPStrategy(comm_state=object())
    with pytest.raises(TypeError, match="DPPFAverager"):
        SignDDPStrategy(averager=object())
