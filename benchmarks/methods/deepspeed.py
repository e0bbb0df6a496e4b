"""What ``deepspeed-step`` builds for each method: one training step on a fresh copy of the
model, the statistics that count its bytes (None: DeepSpeed's own fp32 all-reduce, by formula),
the parameter count and the optimizer whose state a rank holds (None: not reported). Each
builder takes the command's options (``width``, ``depth``, ``batch``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from signmuon.benchmarks.workloads.models import mlp

__all__ = ["ddp_hook", "engine", "zero", "zero_adamw"]

Step = tuple[Callable[[], None], object | None, int, object | None]


def _model_and_batch(args) -> tuple[nn.Module, int, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = mlp(args.width, args.depth)
    x = torch.randn(args.batch, 512)
    y = torch.randint(0, 10, (args.batch,))
    return model, sum(p.numel() for p in model.parameters()), x, y


def ddp_hook(args) -> Step:
    """The same step under DDP with SignSGDMV's hook (the engine's reference)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from signmuon.optim import SignSGDMV

    model, params, x, y = _model_and_batch(args)
    optimizer = SignSGDMV(model.parameters(), lr=1e-4)
    ddp = DDP(model)
    state = optimizer.register_comm_hook(ddp)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    return step, state.stats, params, None


def engine(optimizer: str | None, overlap_backward: bool = True) -> Callable[..., Step]:
    """signmuon's DeepSpeed engine with the config's ``optimizer`` (a sign-vote optimizer by
    name), or DeepSpeed's fp32 all-reduce under a client SGD (``optimizer`` None)."""

    def build(args) -> Step:
        from signmuon.integrations import deepspeed as sm_ds

        model, params, x, y = _model_and_batch(args)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "zero_optimization": {"stage": 0},
            "gradient_clipping": 0.0,
        }
        if optimizer is not None:
            config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-4}}
        client = torch.optim.SGD(model.parameters(), lr=1e-4) if optimizer is None else None
        eng, opt, _, _ = sm_ds.initialize(
            model=model, config=config, optimizer=client, overlap_backward=overlap_backward
        )

        def step():
            eng.backward(nn.functional.cross_entropy(eng(x), y))
            eng.step()

        # Overlapped, the hook state counts the bytes; voting in step(), the optimizer does.
        stats = None if optimizer is None else opt.stats if opt.vote_in_step else opt.comm_state.stats
        return step, stats, params, None

    return build


def _engine_step(eng, x, y) -> Callable[[], None]:
    def step():
        eng.backward(nn.functional.cross_entropy(eng(x), y))
        eng.step()

    return step


def zero(stage: int, optimizer: str, vote: dict | None = None) -> Callable[..., Step]:
    """signmuon's engine at ZeRO ``stage`` (1 or 2): ZeRO inside each node (``LOCAL_WORLD_SIZE``),
    ``optimizer`` voting each rank's partition between nodes (the config's ``"vote"`` section: ``vote``)."""

    def build(args) -> Step:
        from signmuon.integrations import deepspeed as sm_ds

        model, params, x, y = _model_and_batch(args)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-4}},
            "vote": vote or {},
        }
        eng, zero_opt, _, _ = sm_ds.initialize(model=model, config=config)
        # SignMuon's partition step wraps the optimizer that holds the state and counts the bytes.
        inner = getattr(zero_opt.optimizer, "optimizer", zero_opt.optimizer)
        return _engine_step(eng, x, y), inner.stats, params, inner

    return build


def zero_adamw(args) -> Step:
    """DeepSpeed's own ZeRO-2 over every rank (its fp32 reduce-scatter and all-gather) with AdamW."""
    import deepspeed

    model, params, x, y = _model_and_batch(args)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    client = torch.optim.AdamW(model.parameters(), lr=1e-4)
    eng, zero_opt, _, _ = deepspeed.initialize(model=model, config=config, optimizer=client)
    return _engine_step(eng, x, y), None, params, zero_opt.optimizer
