"""What runs after the hook: ``torch.amp.GradScaler``, autocast, clipping and NaN on one rank.

A configuration is a :class:`ScalerConfig`; ``train(rank, world_size, config)`` trains it with
the tiny net of :mod:`.ddp_world` and returns this rank's parameters, loss scale and optimizer
steps; ``simulate(config, world_size)`` is the single-process reference: the workers in a loop,
each scaling its loss and unscaling its gradients as GradScaler does, and a scaler kept by hand.

The definition held to: where any worker's gradient holds NaN or Inf, no parameter moves on any
worker. Under a GradScaler that step is skipped (the optimizer's step count stays) and the scale
backs off on every rank alike, and grows by 2 after ``growth_interval`` finite steps. Under the DDP
hook each worker's momentum has taken in its own finite gradients of that step during backward
(a parameter whose gradient is not finite keeps its momentum); with ``vote_in_step`` a step the
scaler skips never reached the optimizer. Without a scaler the step is taken and moves nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.optim import SignMuon, SignSGDMV, SignumMV
from signmuon.optim.newton_schulz import as_matrix, newton_schulz

from .cells import Cell
from .ddp_world import BETA, ENTRIES, EXACT, LR, Net, batch

STEPS = 6
KLASS = "what runs after the hook"


@dataclass(frozen=True)
class ScalerConfig:
    """One way of training with mixed precision and its overflow bookkeeping.

    Attributes:
        entry: a key of :data:`~.ddp_world.ENTRIES` (not the bare hooks).
        bad: ``((rank, step, what), ...)``: where a gradient turns NaN or Inf; ``what`` is
            ``"all"`` (the loss is NaN) or a parameter's name (its gradient times Inf).
        scaler: train under ``torch.amp.GradScaler("cpu")``.
        give_scaler: pass it to ``opt.use_grad_scaler`` (else a refusal is expected).
        init_scale, growth_interval: the scaler's.
        clip: ``scaler.unscale_`` then ``clip_grad_norm_`` to this before the step (0: off).
        autocast: None, or the autocast dtype ("float16", "bfloat16").
        bucket_mb: DDP's ``bucket_cap_mb`` (tiny: one parameter per bucket).
    """

    entry: str
    bad: tuple[tuple[int, int, str], ...] = ()
    scaler: bool = True
    give_scaler: bool = True
    init_scale: float = 2.0**10
    growth_interval: int = 2
    clip: float = 0.0
    autocast: str | None = None
    bucket_mb: float = 25.0

    @property
    def in_step(self) -> bool:
        return self.entry.endswith("in-step")

    @property
    def kind(self) -> str:
        return self.entry.split("-")[0]


def optimizer_of(config: ScalerConfig, net: nn.Module):
    options = dict(vote=EXACT, vote_in_step=config.in_step)
    if config.kind == "SignMuon":
        return SignMuon(net.parameters(), lr=LR, momentum=BETA, **options)
    if config.kind == "SignSGDMV":
        return SignSGDMV(net.parameters(), lr=LR, **options)
    return SignumMV(net.parameters(), lr=LR, momentum=BETA, **options)


def _autocast(config: ScalerConfig):
    if config.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, config.autocast))


def loss_of(config: ScalerConfig, model, net: nn.Module, rank: int, step: int):
    """This worker's loss at ``step``, with its gradient made non-finite where ``config.bad`` says;
    returns (loss, hooks to remove after backward)."""
    x, y = batch(rank, step, 0)
    hooks, nan_loss = [], False
    for r, s, what in config.bad:
        if (r, s) == (rank, step):
            if what == "all":
                nan_loss = True
            else:
                hooks.append(dict(net.named_parameters())[what].register_hook(lambda g: g * float("inf")))
    with _autocast(config):
        loss = nn.functional.cross_entropy(model(x), y)
    return (loss * float("nan") if nan_loss else loss), hooks


def train(rank: int, world_size: int, config: ScalerConfig) -> dict:
    """Train ``config`` on this rank: its parameters, the scaler's scale, the optimizer's steps."""
    torch.set_num_threads(1)
    net = Net()
    opt = optimizer_of(config, net)
    model = net
    if not config.in_step:
        model = DDP(net, bucket_cap_mb=config.bucket_mb)
        opt.register_comm_hook(model)
    scaler = None
    if config.scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_interval=config.growth_interval)
        if config.give_scaler:
            opt.use_grad_scaler(scaler)
    for step in range(STEPS):
        opt.zero_grad()
        loss, hooks = loss_of(config, model, net, rank, step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        for hook in hooks:
            hook.remove()
        if scaler is not None and config.clip:
            scaler.unscale_(opt)
        if config.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), config.clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return {
        "parameters": [p.detach().clone() for p in net.parameters()],
        "scale": None if scaler is None else scaler.get_scale(),
        "optimizer steps": opt.steps_taken,
    }


# --- the reference -------------------------------------------------------------------------------


def _worker_grads(config: ScalerConfig, params, worker: int, step: int, scale: float | None):
    """One worker's unscaled gradients at ``params``, as GradScaler leaves them."""
    net = Net()
    with torch.no_grad():
        for p, v in zip(net.parameters(), params):
            p.copy_(v)
    loss, hooks = loss_of(config, net, net, worker, step)
    (loss if scale is None else loss * scale).backward()
    for hook in hooks:
        hook.remove()
    if scale is not None:
        for p in net.parameters():
            p.grad.mul_(1.0 / scale)
    return net


def _direction(kind: str, grad: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
    """This worker's direction, advancing ``momentum`` unless ``grad`` is not finite."""
    if not bool(torch.isfinite(grad).all()):
        return grad
    if kind == "SignSGDMV":
        return grad
    momentum.lerp_(grad, 1 - BETA)
    if kind == "SignumMV":
        return momentum.clone()
    look = grad.lerp(momentum, BETA)
    return newton_schulz(as_matrix(look), 5).view_as(look) if look.dim() >= 2 else look


def simulate(config: ScalerConfig, world_size: int) -> dict:
    """Every worker's (identical) parameters, the scale and the step count, by the definition."""
    torch.set_num_threads(1)
    params = [p.detach().clone() for p in Net().parameters()]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    scale = config.init_scale if config.scaler else None
    tracker = steps = 0
    for step in range(STEPS):
        nets = [_worker_grads(config, params, w, step, scale) for w in range(world_size)]
        found = any(not bool(torch.isfinite(p.grad).all()) for n in nets for p in n.parameters())
        if config.clip and config.in_step and not found:  # voted in step(): the momentum sees the clipped gradient
            for n in nets:
                torch.nn.utils.clip_grad_norm_(n.parameters(), config.clip)
        if not (found and config.scaler and config.in_step):  # else step() is never called
            voted = []
            for i in range(len(params)):
                directions = [
                    _direction(config.kind, list(n.parameters())[i].grad, momenta[w][i]) for w, n in enumerate(nets)
                ]
                voted.append(torch.sign(sum(torch.sign(d) for d in directions)))
            if not found:
                params = [p.add(v, alpha=-LR) for p, v in zip(params, voted)]
        if config.scaler:
            if found:
                scale, tracker = scale * 0.5, 0
            else:
                tracker += 1
                if tracker == config.growth_interval:
                    scale, tracker = scale * 2.0, 0
        steps += not (found and config.scaler)
    return {"parameters": params, "scale": scale, "optimizer steps": steps}


# --- the cells -----------------------------------------------------------------------------------

ENTRY_POINTS = ("SignumMV", "SignSGDMV", "SignMuon", "SignumMV-in-step", "SignMuon-in-step")
REFUSAL = "call opt.use_grad_scaler(scaler)"


def _cell(case: str, config: ScalerConfig) -> Cell:
    run = partial(train, config=config)
    if config.scaler and not config.give_scaler:
        return Cell(ENTRIES[config.entry], KLASS, case, run, refusal=REFUSAL)
    atol = 1e-6 if config.kind == "SignMuon" else 0.0  # Newton–Schulz in two processes
    return Cell(ENTRIES[config.entry], KLASS, case, run, partial(simulate, config), atol=atol)


def scaler_cells() -> list[Cell]:
    cells = []
    for entry in ENTRY_POINTS:
        cells += [
            _cell(
                "GradScaler, every gradient NaN on rank 0 at step 1, the scale doubling every 2 steps: "
                "skipped and backed off on every rank",
                ScalerConfig(entry, bad=((0, 1, "all"),)),
            ),
            _cell(
                "GradScaler, unscale_ then clip_grad_norm_(0.1), one parameter's gradient Inf on rank 1 at step 3",
                ScalerConfig(entry, bad=((1, 3, "extra.bias"),), clip=0.1),
            ),
            _cell(
                "fp16 autocast under GradScaler (init scale 2**16), one parameter's gradient Inf on rank 0 at step 2",
                ScalerConfig(entry, bad=((0, 2, "body.0.weight"),), autocast="float16", init_scale=2.0**16),
            ),
            _cell(
                "bf16 autocast without a scaler, one parameter's gradient Inf on rank 1 at step 2: "
                "that step moves nothing on any rank",
                ScalerConfig(entry, bad=((1, 2, "extra.weight"),), scaler=False, autocast="bfloat16", bucket_mb=1e-5),
            ),
            _cell(
                "a GradScaler not given to the optimizer: refused at scaler.step() on every rank",
                ScalerConfig(entry, give_scaler=False),
            ),
            _cell(
                "bf16 autocast under GradScaler, the scale doubling every step, NaN on rank 0 at step 1 and Inf "
                "on rank 1 at step 4, tiny buckets, unscale_ then clip_grad_norm_(0.1)",
                ScalerConfig(
                    entry,
                    bad=((0, 1, "all"), (1, 4, "extra.bias")),
                    autocast="bfloat16",
                    growth_interval=1,
                    bucket_mb=1e-5,
                    clip=0.1,
                ),
            ),
        ]
    return cells
