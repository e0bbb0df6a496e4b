"""DeepSpeed integration (DeepSpeed 0.19.8 on CPU, gloo): config-enabled SignMuon against the
DDP hook, checkpoints, refused configs, pass-through, and the compressed backend."""

import contextlib
import os
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.integrations.deepspeed import SignCompressedBackend, initialize
from signmuon.integrations.deepspeed.engine import read_rank_file
from signmuon.optim import SignMuon
from tests.harness import capture, compressed_allreduce_reference, run_distributed

# DeepSpeed compiles a shared-memory op at its first init_distributed (~60 s): build it once
# into a cache the spawned ranks inherit.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions")
)

OPT_PARAMS = {"lr": 0.01, "momentum": 0.9, "polar_after_vote": True, "weight_decay": 0.01}
STEPS = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _micro_batch(rank, step, micro):
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def _config(gas=1, optimizer_type="SignMuon", **extra):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer_type, "params": dict(OPT_PARAMS)},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the DDP hook does not clip
        **extra,
    }


def _deepspeed_run(
    rank, world_size, gas, steps, start=0, load=None, save=None, scheduler=False, overlap=True, clip=0.0, bf16=False
):
    extra = (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}
        if scheduler
        else {}
    )
    extra |= {"bf16": {"enabled": True}} if bf16 else {}
    model = _model()
    config = {**_config(gas, **extra), "gradient_clipping": clip}
    engine, optimizer, _, lr_scheduler = initialize(model=model, config=config, overlap_backward=overlap)
    assert engine.enable_backward_allreduce is False
    if load:
        engine.load_checkpoint(load, tag="t")
    history, lrs, voted_in_backward = [], [], []
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = _micro_batch(rank, step, micro)
            engine.backward(nn.functional.cross_entropy(engine(x.bfloat16() if bf16 else x), y))
            # Overlapped: the vote (entries in {-1, 0, 1}) is in .grad when backward returns,
            # and only at the accumulation boundary.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            voted_in_backward.append(all(bool(((g == 0) | (g.abs() == 1)).all()) for g in grads))
            engine.step()
        history.append([p.detach().clone() for p in model.parameters()])
        lrs.append(optimizer.param_groups[0]["lr"])
    if save:
        engine.save_checkpoint(save, tag="t")
    hook_calls = optimizer.comm_state.stats.calls if overlap else 0
    masters = [optimizer.state[p]["master_weight"].clone() for p in model.parameters()] if bf16 else []
    return dict(
        history=history,
        lrs=lrs,
        scheduler=type(lr_scheduler).__name__,
        voted_in_backward=voted_in_backward,
        hook_calls=hook_calls,
        step_bytes=optimizer.stats.bytes_sent,
        masters=masters,
    )


def _ddp_run(rank, world_size, gas, steps, bf16=False):
    net = _model().to(torch.bfloat16 if bf16 else torch.float32)
    opt = SignMuon(net.parameters(), **OPT_PARAMS, master_weights=bf16)
    model = DDP(net)
    opt.register_comm_hook(model)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(gas):
            x, y = _micro_batch(rank, step, micro)
            sync = contextlib.nullcontext() if micro == gas - 1 else model.no_sync()
            with sync:  # no_sync must cover the forward too
                loss = nn.functional.cross_entropy(model(x.bfloat16() if bf16 else x), y)
                (loss / gas).backward()  # DeepSpeed scales by 1/gas too
        opt.step()
        history.append([p.detach().clone() for p in net.parameters()])
    return dict(history=history)


def _both(rank, world_size, gas, overlap, clip):
    return _deepspeed_run(rank, world_size, gas, STEPS, overlap=overlap, clip=clip), _ddp_run(
        rank, world_size, gas, STEPS
    )


@pytest.mark.parametrize(
    "gas, overlap, clip",
    [(1, True, 1.0), (2, True, 0.01), (2, False, 0.0)],
    ids=["overlapped-default-clipping", "overlapped-accumulation-clipping", "in-step-accumulation"],
)
def test_config_signmuon_equals_ddp_hook_step_for_step(gas, overlap, clip):
    """The engine votes as the DDP hook does (overlapped: in backward, only at accumulation
    boundaries; DeepSpeed's gradient clipping then rescales the vote and changes nothing)."""
    results = run_distributed(_both, 2, gas, overlap, clip, timeout=600)
    for rank, (ds, ddp) in enumerate(results):
        for step in range(STEPS):
            for a, b in zip(ds["history"][step], ddp["history"][step]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"rank {rank} step {step}")
        if overlap:
            boundary = [micro == gas - 1 for _ in range(STEPS) for micro in range(gas)]
            assert ds["voted_in_backward"][gas - 1 :: gas] == boundary[gas - 1 :: gas]
            if gas > 1:  # the first micro-batch's gradient is raw, not voted
                assert not any(ds["voted_in_backward"][0::gas])
            assert ds["hook_calls"] >= STEPS and ds["step_bytes"] == 0
        else:
            assert ds["hook_calls"] == 0 and ds["step_bytes"] > 0
    assert not torch.equal(results[0][0]["history"][0][0], results[0][0]["history"][-1][0])
    for a, b in zip(results[0][0]["history"][-1], results[1][0]["history"][-1]):
        assert torch.equal(a, b), "replicas diverged"


def _bf16_both(rank, world_size):
    return _deepspeed_run(rank, world_size, 1, STEPS, bf16=True), _ddp_run(rank, world_size, 1, STEPS, bf16=True)


def test_bf16_votes_bf16_gradients_and_updates_float32_master_weights():
    results = run_distributed(_bf16_both, 2, timeout=600)
    for rank, (ds, ddp) in enumerate(results):
        for step in range(STEPS):
            for a, b in zip(ds["history"][step], ddp["history"][step]):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b), f"rank {rank} step {step}"
        for p, master in zip(ds["history"][-1], ds["masters"]):
            assert master.dtype == torch.float32 and torch.equal(p, master.bfloat16())
        # The masters hold what bf16 cannot: updates of lr=0.01 accumulate below bf16's spacing.
        assert any(not torch.equal(m, m.bfloat16().float()) for m in ds["masters"])
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["history"][-1], results[1][0]["history"][-1]))


def _load_worker(rank, world_size, load):
    engine, _, _, _ = initialize(model=_model(), config=_config(), overlap_backward=True)
    return capture(lambda: engine.load_checkpoint(load, tag="t"))


class _RunsCode:
    """Unpickled, it makes the directory ``marker``: a harmless stand-in for running any code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_rank_state_file_holding_a_pickled_object_is_refused_naming_it(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "signmuon_optimizer_rank00000.pt"
    torch.save({"state": {0: {"momentum": torch.ones(2)}}, "hook": _RunsCode(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError, match="signmuon_optimizer_rank00000.pt") as refused:
        read_rank_file(str(path))
    assert "posix.mkdir" in str(refused.value) and not marker.exists()
    torch.load(path, weights_only=False)  # the file is live: unpickling it does run the code
    assert marker.is_dir()


def test_rank_state_file_of_plain_state_loads(tmp_path):
    opt = SignMuon(_model().parameters(), lr=0.01)
    opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"] = torch.ones(16, 8)
    torch.save(opt.state_dict(), tmp_path / "rank.pt")
    loaded = read_rank_file(str(tmp_path / "rank.pt"))
    assert torch.equal(loaded["state"][0]["momentum_buffer"], torch.ones(16, 8))


def test_checkpoint_resume_and_scheduler(tmp_path):
    whole = run_distributed(_deepspeed_run, 2, 1, 4, 0, None, None, True, timeout=600)
    run_distributed(_deepspeed_run, 2, 1, 2, 0, None, str(tmp_path), True, timeout=600)
    resumed = run_distributed(_deepspeed_run, 2, 1, 2, 2, str(tmp_path), None, True, timeout=600)
    for r in range(2):
        for a, b in zip(whole[r]["history"][-1], resumed[r]["history"][-1]):
            assert torch.equal(a, b), "resumed run differs (momentum of some rank lost?)"
    # Each rank's optimizer state in a file of its own; rank 0's DeepSpeed file holds no other rank's.
    assert sorted(p.name for p in (tmp_path / "t").glob("signmuon_optimizer_rank*.pt")) == [
        "signmuon_optimizer_rank00000.pt",
        "signmuon_optimizer_rank00001.pt",
    ]
    for path in (tmp_path / "t").glob("*model_states.pt"):
        optimizer_state = torch.load(path, weights_only=False)["optimizer"]
        assert "rank_states" not in optimizer_state["signmuon"]
    (tmp_path / "t" / "signmuon_optimizer_rank00001.pt").unlink()
    missing = run_distributed(_load_worker, 2, str(tmp_path), timeout=600)
    assert missing[1].startswith("FileNotFoundError") and "rank00001" in missing[1]
    assert missing[0].startswith("ValueError") and "rank(s) [1]" in missing[0]  # every rank refuses
    # A tampered rank file (a pickled object that runs code when loaded) is refused, not run.
    marker = tmp_path / "ran"
    torch.save({"state": _RunsCode(str(marker))}, tmp_path / "t" / "signmuon_optimizer_rank00001.pt")
    tampered = run_distributed(_load_worker, 2, str(tmp_path), timeout=600)
    assert tampered[1].startswith("UnpicklingError") and "rank00001" in tampered[1]
    assert tampered[0].startswith("ValueError") and "rank(s) [1]" in tampered[0]
    assert not marker.exists()
    # DeepSpeed's WarmupLR drives our optimizer's lr (and is checkpointed with it).
    assert whole[0]["scheduler"] == "WarmupLR"
    assert whole[0]["lrs"][0] < whole[0]["lrs"][2] == pytest.approx(0.01)
    assert resumed[0]["lrs"] == whole[0]["lrs"][2:]


def _passthrough(rank, world_size):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
    engine, _, _, _ = initialize(model=model, config=config, optimizer=opt)
    x, y = _micro_batch(rank, 0, 0)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    grads = [p.grad.clone() for p in model.parameters()]
    local = _model()
    nn.functional.cross_entropy(local(x), y).backward()
    return engine.enable_backward_allreduce, grads, [p.grad.clone() for p in local.parameters()]


def test_config_without_our_types_is_plain_deepspeed():
    results = run_distributed(_passthrough, 2, timeout=600)
    allreduce_on = results[0][0]
    assert allreduce_on
    for i in range(len(results[0][1])):
        mean = (results[0][2][i] + results[1][2][i]) / 2
        torch.testing.assert_close(results[0][1][i], mean, rtol=1e-5, atol=1e-7)  # DeepSpeed averaged grads


@pytest.mark.parametrize(
    "config, match",
    [
        (
            _config(optimizer_type="signmuon") | {"optimizer": {"type": "SignMuon", "params": {"lr": 0.1, "betas": 1}}},
            r"unknown params \['betas'\].*valid: \[.*'momentum'",
        ),
        (_config(zero_optimization={"stage": 3}), 'ZeRO stage 3.*"stage": 2'),
        (_config(fp16={"enabled": True}), "fp16.*fp32"),
        (_config(bf16={"enabled": True, "immediate_grad_update": True}), r"bf16 settings \['immediate_grad_update'\]"),
        (
            _config(optimizer_type="SIGNUMMV")
            | {"optimizer": {"type": "SIGNUMMV", "params": {"polar_after_vote": True}}},
            r"unknown params \['polar_after_vote'\] for optimizer SIGNUMMV",
        ),
        (
            _config(optimizer_type="SignumMV")
            | {"optimizer": {"type": "SignumMV", "params": {"lr": 0.1, "vote_in_step": True}}},
            r"\['vote_in_step'\] in the DeepSpeed config's optimizer params.*overlap_backward=False",
        ),
        (
            _config(csv_monitor={"enabled": True, "output_path": "logs", "job_name": "../x"}),
            "csv_monitor.job_name='../x'",
        ),
        (_config(tensorboard={"enabled": True, "job_name": "/tmp/x"}), "plain directory name"),
    ],
)
def test_refused_configs(config, match):
    with pytest.raises(ValueError, match=match):
        initialize(model=_model(), config=config)


def test_bf16_in_an_engine_built_elsewhere_is_refused():
    # The HF Trainer builds its engine itself: DeepSpeed's bf16 optimizer would flatten the parameters.
    from signmuon.integrations.deepspeed import check_supported

    check_supported(_config(bf16={"enabled": True}), "SignMuon")  # ours: float32 master weights
    with pytest.raises(ValueError, match="built elsewhere.*signmuon.integrations.deepspeed.initialize"):
        check_supported(_config(bf16={"enabled": True}), "SignMuon", bf16=False)


# --- the compressed backend --------------------------------------------------------------


def _backend_worker(rank, world_size, shape, calls):
    from signmuon.comm_hooks import VoteConfig

    backend = SignCompressedBackend(vote=VoteConfig(tie="exact"))  # the literal sign(sum sign)
    n = torch.Size(shape).numel()
    padded = -(-n // (8 * world_size)) * 8 * world_size
    worker_error, server_error = torch.zeros(padded), torch.zeros(padded // world_size)
    outs = []
    for call in range(calls):
        buffer = torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + call))
        backend.compressed_allreduce(buffer, worker_error, server_error, local_rank=0)
        outs.append((buffer.clone(), worker_error.clone(), server_error.clone()))
    voted = backend.majority_vote(torch.randn(37, generator=torch.Generator().manual_seed(rank)))
    return outs, voted, backend.stats.bytes_sent


@pytest.mark.parametrize("world_size, shape", [(2, (5, 7)), (3, (100,))])
def test_compressed_allreduce_matches_reference(world_size, shape):
    calls = 3
    results = run_distributed(_backend_worker, world_size, shape, calls)
    n = torch.Size(shape).numel()
    padded = -(-n // (8 * world_size)) * 8 * world_size
    worker_errors = [torch.zeros(padded) for _ in range(world_size)]
    server_errors = [torch.zeros(padded // world_size) for _ in range(world_size)]
    for call in range(calls):
        buffers = [
            torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + call)) for r in range(world_size)
        ]
        expected, worker_errors, server_errors = compressed_allreduce_reference(buffers, worker_errors, server_errors)
        for r in range(world_size):
            out, w_err, s_err = results[r][0][call]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w_err, worker_errors[r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s_err, server_errors[r], rtol=1e-5, atol=1e-6)
    votes = torch.stack(
        [torch.sign(torch.randn(37, generator=torch.Generator().manual_seed(r))) for r in range(world_size)]
    )
    assert torch.equal(results[0][1], torch.sign(votes.sum(0)))
    assert results[0][2] > 0


def test_backend_rejects_bad_buffers():
    backend = SignCompressedBackend()
    with pytest.raises(ValueError, match="multiple of 8"):
        backend.compressed_allreduce(torch.randn(10), torch.zeros(12), torch.zeros(12))
    with pytest.raises(ValueError, match="server_error"):
        backend.compressed_allreduce(torch.randn(10), torch.zeros(16), torch.zeros(3))


def _node_aware_both(rank, world_size):
    """The DeepSpeed config's "vote" section switches on the node-aware vote, as the DDP hook's VoteConfig does."""
    from signmuon.comm_hooks import VoteConfig

    vote = {"hierarchical": True, "ranks_per_node": 2, "tie": "exact"}
    model = _model()
    engine, ds_opt, _, _ = initialize(model=model, config=_config(vote=vote))
    ds = []
    for step in range(3):
        x, y = _micro_batch(rank, step, 0)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
        ds.append([p.detach().clone() for p in model.parameters()])
    net = _model()
    opt = SignMuon(net.parameters(), vote=VoteConfig(**vote), **OPT_PARAMS)
    ddp = DDP(net)
    opt.register_comm_hook(ddp)
    hooked = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = _micro_batch(rank, step, 0)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        hooked.append([p.detach().clone() for p in net.parameters()])
    return ds, hooked, (ds_opt.comm_state.stats.bytes_sent_inside_node, opt.comm_state.stats.bytes_sent_inside_node)


def test_config_vote_section_runs_the_node_aware_vote():
    results = run_distributed(_node_aware_both, 4, timeout=600)
    for rank, (ds, hooked, inside) in enumerate(results):
        assert min(inside) > 0, "both ran the node-aware path"
        for step in range(3):
            for a, b in zip(ds[step], hooked[step]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"rank {rank} step {step}")
    for a, b in zip(results[0][0][-1], results[3][0][-1]):
        assert torch.equal(a, b)
