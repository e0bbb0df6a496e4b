"""Lightning, Accelerate and the HF Trainer with their real packages, 2 gloo ranks on CPU, tiny
models built in the test (nothing downloaded): hooks called, bytes counted, clipping changes
nothing, loss goes down, and the ways a framework drops a hook fail loudly."""

import os

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

from .harness import capture

STEPS = 6


def _data(rank: int, n: int = 48) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 6, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


# -- Lightning ---------------------------------------------------------------------------------


def _lightning_fit(rank, make_optimizer, strategy, clip=None, steps=STEPS):
    import lightning.pytorch as pl

    from .harness import tiny_net

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
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module


def _lightning(rank, world_size):
    os.environ["NODE_RANK"] = "0"
    from signmuon.comm_hooks import SignVoteState
    from signmuon.integrations.lightning import SignDDPStrategy
    from signmuon.optim import LocalStepAverager, SignMuon, SignumMV

    out = {}
    for name, make in {
        "SignMuon": lambda ps: SignMuon(ps, lr=0.02),
        "SignumMV": lambda ps: SignumMV(ps, lr=0.02),
    }.items():
        runs = [_lightning_fit(rank, make, SignDDPStrategy(), clip) for clip in (None, 0.01)]
        out[name] = dict(
            params=[[p.detach().clone() for p in m.parameters()] for m in runs],
            calls=runs[0].made.comm_state.stats.calls,
            losses=runs[0].losses,
        )
    state = SignVoteState(momentum=0.9)
    module = _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.02), SignDDPStrategy(comm_state=state))
    out["hook"] = dict(
        calls=state.stats.calls, sent=state.stats.bytes_sent, params=[p.detach().clone() for p in module.parameters()]
    )
    out["hook_clip"] = capture(
        lambda: _lightning_fit(
            rank, lambda ps: torch.optim.SGD(ps, lr=0.02), SignDDPStrategy(comm_state=SignVoteState()), 1.0
        )
    )
    averager = LocalStepAverager(period=2, pull=0.5, push=0.01)
    module = _lightning_fit(rank, lambda ps: torch.optim.SGD(ps, lr=0.05), SignDDPStrategy(averager=averager))
    out["dppf"] = dict(
        rounds=averager.rounds, sent=averager.stats.bytes_sent, params=[p.detach().clone() for p in module.parameters()]
    )
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
    with pytest.raises(TypeError, match="LocalStepAverager"):
        SignDDPStrategy(averager=object())


# -- Accelerate ----------------------------------------------------------------------------------


def _accelerate(rank, world_size):
    from accelerate import Accelerator

    from signmuon.comm_hooks import SignVoteState
    from signmuon.integrations.accelerate import register_comm_hook
    from signmuon.optim import SignSGDMV

    from .harness import tiny_net

    def fit(make, clip=None, comm_state=None, register=True):
        accelerator = Accelerator(cpu=True)
        net = tiny_net()
        loader = torch.utils.data.DataLoader(_data(0, 96), batch_size=8)
        model, optimizer, loader = accelerator.prepare(net, make(net.parameters()), loader)
        state = register_comm_hook(accelerator, model, optimizer, comm_state=comm_state) if register else comm_state
        if not register:
            model.register_comm_hook(state, __import__("signmuon.comm_hooks").comm_hooks.sign_vote_hook)
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
        return [p.detach().clone() for p in net.parameters()], state, losses

    out = {}
    runs = [fit(lambda ps: SignSGDMV(ps, lr=0.02), clip) for clip in (None, 0.01)]
    out["signsgd"] = dict(params=[r[0] for r in runs], calls=runs[0][1].stats.calls, losses=runs[0][2])
    params, state, _ = fit(lambda ps: torch.optim.SGD(ps, lr=0.02), comm_state=SignVoteState(momentum=0.9))
    out["hook"] = dict(params=params, calls=state.stats.calls, sent=state.stats.bytes_sent)
    out["not_voting"] = capture(lambda: fit(lambda ps: torch.optim.SGD(ps, lr=0.02)))
    return out


def test_accelerate_registers_the_vote_after_prepare():
    pytest.importorskip("accelerate", reason="the accelerate extra")
    results = run_distributed(_accelerate, 2, timeout=300)
    for out in results:
        run = out["signsgd"]
        assert run["calls"] >= STEPS
        assert sum(run["losses"][-2:]) < sum(run["losses"][:2]), run["losses"]
        for a, b in zip(*run["params"]):
            assert torch.equal(a, b), "accelerator.clip_grad_norm_ changed SignSGDMV's update"
        assert out["hook"]["calls"] >= STEPS and out["hook"]["sent"] > 0
        assert out["not_voting"].startswith("ValueError") and "comm_state" in out["not_voting"]
    for a, b in zip(results[0]["hook"]["params"], results[1]["hook"]["params"]):
        assert torch.equal(a, b), "replicas agree"


# -- HF Trainer ----------------------------------------------------------------------------------


def _gpt2():
    """A 2-layer GPT-2 from a config (tied embedding and head), nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, 8, (1,), generator=gen))
        ids = (torch.arange(16) * 3 + start) % 32  # a learnable pattern
        return {"input_ids": ids, "labels": ids}


def _trainer(rank, world_size, tmp, deepspeed):
    from transformers import TrainingArguments

    from signmuon.integrations.transformers import SignTrainer

    def fit(max_grad_norm, spec, optimizers=(None, None)):
        model = _gpt2()
        args = TrainingArguments(
            output_dir=tmp,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            learning_rate=0.01,
            max_grad_norm=max_grad_norm,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
            deepspeed={
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 0},
            }
            if deepspeed
            else None,
        )
        trainer = SignTrainer(
            model=model, args=args, train_dataset=_Tokens(), sign_optimizer=spec, optimizers=optimizers
        )
        probe = torch.stack([_Tokens()[i]["input_ids"] for i in range(8)])
        with torch.no_grad():
            before = model(input_ids=probe, labels=probe).loss.item()
        result = trainer.train()
        with torch.no_grad():
            after = model(input_ids=probe, labels=probe).loss.item()
        opt = trainer.optimizer
        while not hasattr(opt, "comm_state"):
            opt = opt.optimizer
        engine = trainer.model_wrapped
        return dict(
            params=[p.detach().clone() for p in model.parameters()],
            loss=result.training_loss,
            calls=opt.comm_state.stats.calls,
            sent=opt.comm_state.stats.bytes_sent,
            allreduce=getattr(engine, "enable_backward_allreduce", None),
            type=type(opt).__name__,
            lr=opt.param_groups[0]["initial_lr"],
            losses=(before, after),
        )

    spec = {"type": "SignumMV", "params": {"momentum": 0.9}}
    out = {"clipped": fit(1.0, spec), "unclipped": fit(0.0, spec)}
    if not deepspeed:
        out["muon"] = fit(1.0, None)
        out["adamw"] = capture(lambda: fit(1.0, None, optimizers=(torch.optim.AdamW(_gpt2().parameters()), None)))
    return out


@pytest.mark.parametrize("deepspeed", [False, True], ids=["ddp", "deepspeed"])
def test_hf_trainer_builds_our_optimizer_and_votes(tmp_path, deepspeed):
    pytest.importorskip("transformers", reason="the transformers extra")
    if deepspeed:
        pytest.importorskip("deepspeed", reason="the deepspeed extra")
        os.environ.setdefault(
            "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions")
        )
    results = run_distributed(_trainer, 2, str(tmp_path), deepspeed, timeout=400)
    for out in results:
        clipped, unclipped = out["clipped"], out["unclipped"]
        assert clipped["type"] == "SignumMV" and clipped["lr"] == 0.01
        assert clipped["calls"] >= STEPS and clipped["sent"] > 0, "the vote ran"
        assert clipped["losses"][1] < clipped["losses"][0], f"loss goes down: {clipped['losses']}"
        for a, b in zip(clipped["params"], unclipped["params"]):
            assert torch.equal(a, b), "max_grad_norm changed the update"
        if deepspeed:
            assert clipped["allreduce"] is False, "the engine's fp32 all-reduce is off"
        else:
            assert out["muon"]["type"] == "SignMuon" and out["muon"]["calls"] >= STEPS
            assert out["adamw"].startswith("ValueError") and "AdamW" in out["adamw"]
    for a, b in zip(results[0]["clipped"]["params"], results[1]["clipped"]["params"]):
        assert torch.equal(a, b), "replicas agree"


# -- a hook a framework dropped ------------------------------------------------------------------


@pytest.mark.parametrize("with_closure", [False, True], ids=["step", "step-with-closure"])
def test_a_hook_that_never_ran_raises_at_the_first_step(with_closure):
    """What a framework that silently drops a hook leaves: a state that saw no bucket. The
    first step raises with the framework's fix; a closure step (Lightning's) is checked after
    its backward."""
    from signmuon.comm_hooks import SignVoteState

    from .harness import batch, tiny_net

    net = tiny_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = SignVoteState()
    state.check_called_by_first_step(opt, fix="Do the framework's thing.")
    x, y = batch(0, 0)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="has not run since it was registered.*Do the framework's thing"):
        opt.step(closure) if with_closure else (closure(), opt.step())
    closure()
    opt.step()  # checked once: the watch is gone after the first step
