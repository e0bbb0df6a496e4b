"""What ``deepspeed-step`` builds for each method: one training step on a fresh copy of the
model, the statistics that count its bytes (None: DeepSpeed's own fp32 all-reduce, by formula)
and the parameter count. Each builder takes the command's options (``width``, ``depth``,
``batch``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from signmuon.benchmarks.workloads.models import mlp

__all__ = ["ddp_hook", "engine"]

Step = tuple[Callable[[], None], object | None, int]


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

    return step, state.stats, params


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
        return step, stats, params

    return build
