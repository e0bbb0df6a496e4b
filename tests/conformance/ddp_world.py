"""The DDP side of the hook cells: one training run of a configuration on every rank, and the
plain single-process reference it must equal (workers simulated in a loop, no process group).

A configuration is a :class:`Config`; ``train(rank, world_size, config)`` returns this rank's
final parameters, ``simulate(config, world_size)`` every rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import SignVoteState, VoteConfig, sign_vote_hook
from signmuon.optim import SignMuon, SignSGDMV, SignumMV
from signmuon.optim.newton_schulz import as_matrix, newton_schulz

from .cells import Cell

LR, BETA = 0.01, 0.9
EXACT = VoteConfig(tie="exact")
HOOKED = ("hook-signsgd", "hook-signum", "SignumMV", "SignSGDMV", "SignMuon")
GROUPS = ((0.01, 0.1), (0.03, 0.0), (0.002, 0.5))
"""(lr, weight_decay) of body.0, body.2 and extra where ``Config.param_groups``."""

ENTRIES = {
    "hook-signsgd": "sign_vote_hook, signSGD-MV",
    "hook-signum": "sign_vote_hook, Signum-MV",
    "SignumMV": "SignumMV, DDP hook",
    "SignSGDMV": "SignSGDMV, DDP hook",
    "SignMuon": "SignMuon, DDP hook",
    "SignumMV-in-step": "SignumMV, vote_in_step",
    "SignMuon-in-step": "SignMuon, vote_in_step",
}
"""Config.entry -> the entry point's name in the matrix."""


@dataclass(frozen=True)
class Config:
    """One way of calling an entry point.

    Attributes:
        entry: a key of :data:`ENTRIES`.
        steps: batches per rank (a rank with fewer joins early, under ``Join``).
        groups: data-parallel groups of global ranks (None: one group of all).
        give_group: pass the group to the state or optimizer ourselves ("ddp": the DDP group,
            "world": WORLD, whatever DDP's is, "none": nothing).
        unused_on: ranks on which the extra head gets no gradient (``find_unused_parameters``).
        micro: micro-batches per step, accumulated under ``no_sync``.
        clip: clip the gradients' norm to this between backward and ``step()`` (0: off).
        added_later: the extra head joins the optimizer by ``add_param_group`` after the hook.
        per_node: ranks per node of the node-aware vote (0: the flat vote).
        join: run under DDP's ``Join`` (uneven ``steps``).
    """

    entry: str
    steps: tuple[int, ...] = (4, 4)
    groups: tuple[tuple[int, ...], ...] | None = None
    give_group: str = "none"
    unused_on: tuple[int, ...] = ()
    micro: int = 1
    clip: float = 0.0
    added_later: bool = False
    per_node: int = 0
    join: bool = False
    sync_every_micro: bool = False
    """Every micro-batch's backward syncs (a second backward before ``step()``, no ``no_sync``)."""
    set_to_none: bool = True
    """``zero_grad``'s: False zeroes the gradients in place."""
    ddp_kwargs: tuple[tuple[str, object], ...] = ()
    """More of DDP's constructor options (static_graph, gradient_as_bucket_view, bucket_cap_mb)."""
    param_groups: bool = False
    """Three groups (body.0, body.2, extra) with :data:`GROUPS`' lr and weight_decay."""
    non_matrix: str = "signum"
    """SignMuon's path for the biases: "adamw" is torch's AdamW on the mean of every rank's gradient."""

    @property
    def vote(self) -> VoteConfig:
        """Ties vote 0 (the definition, with no coins to simulate); node-aware where ``per_node``."""
        if self.per_node:
            return VoteConfig(tie="exact", hierarchical=True, ranks_per_node=self.per_node)
        return VoteConfig(tie="exact")

    @property
    def in_step(self) -> bool:
        return self.entry.endswith("in-step")

    @property
    def warmup(self) -> int:
        return 1 if self.entry == "hook-signum" else 0  # per-bucket momentum needs start_iter >= 1


class Net(nn.Module):
    """The tiny MLP and an extra head some ranks leave out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        self.extra = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


def backward(model, rank: int, step: int, micro: int, use_extra: bool) -> None:
    x, y = batch(rank, step, micro)
    nn.functional.cross_entropy(model(x, use_extra), y).backward()


# --- the run on every rank -----------------------------------------------------------------


def _groups(config: Config, rank: int):
    """(this rank's data-parallel group or None, the group to hand over as ``give_group`` says)."""
    group = None
    for ranks in config.groups or ():
        made = dist.new_group(list(ranks))
        if rank in ranks:
            group = made
    given = {"none": None, "ddp": group, "world": dist.group.WORLD}[config.give_group]
    return group, given


def make_optimizer(config: Config, net: Net, given):
    """``config``'s optimizer of ``net`` (``given``: the process group it is handed, or None)."""
    options = dict(process_group=given, vote_in_step=config.in_step, vote=config.vote)
    params = list(net.body.parameters()) if config.added_later else list(net.parameters())
    if config.param_groups:
        layers = (net.body[0], net.body[2], net.extra)
        params = [dict(params=list(m.parameters()), lr=lr, weight_decay=wd) for m, (lr, wd) in zip(layers, GROUPS)]
    kind = config.entry.split("-")[0]
    if kind == "SignMuon":
        opt = SignMuon(params, lr=LR, momentum=BETA, non_matrix=config.non_matrix, **options)
    elif kind == "SignSGDMV":
        opt = SignSGDMV(params, lr=LR, **options)
    else:
        opt = SignumMV(params, lr=LR, momentum=BETA, **options)
    return opt


def ddp_cell(klass: str, case: str, config: Config, refusal: str | None = None) -> Cell:
    """A cell of ``config``: equal to :func:`simulate` rank by rank, or refused with ``refusal``."""
    atol = 1e-6 if config.entry.startswith("SignMuon") else 0.0  # Newton–Schulz in two processes
    if refusal is not None:
        return Cell(ENTRIES[config.entry], klass, case, partial(train, config=config), refusal=refusal)
    return Cell(
        ENTRIES[config.entry],
        klass,
        case,
        partial(train, config=config),
        partial(simulate, config),
        atol=atol,
        per_rank=True,
    )


def hooked(entry: str, net: Net, model) -> torch.optim.Optimizer:
    """The entry's hook on DDP ``model`` and the optimizer that applies it."""
    config = Config(entry)
    if entry.startswith("hook-"):
        momentum = BETA if entry == "hook-signum" else 0.0
        model.register_comm_hook(SignVoteState(momentum=momentum, start_iter=config.warmup, vote=EXACT), sign_vote_hook)
        return torch.optim.SGD(net.parameters(), lr=LR)
    opt = make_optimizer(config, net, None)
    opt.register_comm_hook(model)
    return opt


def train(rank: int, world_size: int, config: Config) -> list[torch.Tensor]:
    """Train ``config`` on this rank; its final parameters."""
    torch.set_num_threads(1)
    group, given = _groups(config, rank)
    net = Net()
    use_extra = rank not in config.unused_on
    if config.in_step:
        model, opt = net, make_optimizer(config, net, given if config.give_group != "none" else group)
        for p in net.parameters():  # what DDP's start-up broadcast gives: rank 0's weights
            dist.broadcast(p.data, 0)
    else:
        options = {"find_unused_parameters": bool(config.unused_on), **dict(config.ddp_kwargs)}
        model = DDP(net, process_group=group, **options)
        if config.entry.startswith("hook-"):
            momentum = BETA if config.entry == "hook-signum" else 0.0
            state = SignVoteState(given, momentum=momentum, start_iter=config.warmup, vote=config.vote)
            model.register_comm_hook(state, sign_vote_hook)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        else:
            opt = make_optimizer(config, net, given)
            opt.register_comm_hook(model)
        if config.added_later:
            opt.add_param_group({"params": list(net.extra.parameters())})
    steps = config.steps[rank]
    with Join([model]) if config.join else _nothing():
        for step in range(steps):
            opt.zero_grad(set_to_none=config.set_to_none)
            for micro in range(config.micro):
                last = micro == config.micro - 1
                with _nothing() if last or config.in_step or config.sync_every_micro else model.no_sync():
                    backward(model, rank, step, micro, use_extra)
            if config.clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), config.clip)
            opt.step()
    return [p.detach().clone() for p in net.parameters()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- the reference: workers in a loop ----------------------------------------------------------


def _grads(config: Config, params: list[torch.Tensor], worker: int, step: int) -> list[torch.Tensor | None]:
    """One worker's gradients at ``params``: None for a parameter it did not use."""
    torch.set_num_threads(1)
    net = Net()
    with torch.no_grad():
        for p, v in zip(net.parameters(), params):
            p.copy_(v)
    for micro in range(config.micro):
        backward(net, worker, step, micro, worker not in config.unused_on)
    if config.clip and config.in_step:  # voted in step(): each worker's momentum sees its clipped gradient
        torch.nn.utils.clip_grad_norm_(net.parameters(), config.clip)
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def _direction(config: Config, grad, momentum, index: int):
    """This worker's direction of parameter ``index`` (advancing ``momentum``), or zeros where it has no gradient."""
    if grad is None or not bool(grad.ne(0).any()):
        return torch.zeros_like(momentum)  # abstains; its momentum stays put
    kind = config.entry.split("-")[0]
    if kind in ("hook", "SignSGDMV") and config.entry != "hook-signum":
        return grad
    momentum.lerp_(grad, 1 - BETA)
    if kind != "SignMuon":
        return momentum.clone()
    look = grad.lerp(momentum, BETA)
    return newton_schulz(as_matrix(look), 5).view_as(look) if look.dim() >= 2 else look


def _node_means(config: Config, grads: dict, workers: tuple[int, ...]) -> dict:
    """Each node's mean gradient (summed in rank order, missing ones as zeros, then divided), by
    its first rank: the voters of the node-aware vote; None where no rank of the node has one."""
    means = {}
    for first in workers[:: config.per_node]:
        members = [grads[w] for w in workers[workers.index(first) : workers.index(first) + config.per_node]]
        if all(m is None for m in members):
            means[first] = None
            continue
        count = len(next(m for m in members if m is not None))
        per_param = []
        for i in range(count):
            present = [m[i] for m in members if m is not None and m[i] is not None]
            if not present:
                per_param.append(None)
                continue
            total = torch.zeros_like(present[0])
            for m in members:
                if m is not None and m[i] is not None:
                    total = total + m[i]
            per_param.append(total / config.per_node)
        means[first] = per_param
    return means


def _simulate_group(config: Config, workers: tuple[int, ...]) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in Net().parameters()]
    voters = workers[:: config.per_node] if config.per_node else workers
    momenta = {w: [torch.zeros_like(p) for p in params] for w in voters}
    hyper = [h for h in GROUPS for _ in range(2)] if config.param_groups else [(LR, 0.0)] * len(params)
    adamw = _AdamW(config, params, hyper)
    for step in range(max(config.steps[w] for w in workers)):
        grads = {w: _grads(config, params, w, step) if step < config.steps[w] else None for w in workers}
        means = adamw.step(params, grads, workers)
        if config.per_node:
            grads = _node_means(config, grads, workers)
        if step < config.warmup:  # the all-reduced mean; a rank without a gradient adds zeros
            mean = [
                sum((grads[w][i] if grads[w] and grads[w][i] is not None else torch.zeros_like(p)) for w in workers)
                / len(workers)
                for i, p in enumerate(params)
            ]
            params = [p.add(m, alpha=-LR) for p, m in zip(params, mean)]
            continue
        voted = []
        for i, p in enumerate(params):
            directions = [_direction(config, grads[w][i] if grads[w] else None, momenta[w][i], i) for w in voters]
            voted.append(torch.sign(sum(torch.sign(d) for d in directions)))
        if config.param_groups:  # decoupled: W * (1 - lr * wd) - lr * vote
            params = [p * (1 - lr * wd) - lr * v for p, v, (lr, wd) in zip(params, voted, hyper)]
        else:
            params = [p.add(v, alpha=-LR) for p, v in zip(params, voted)]
        params = [p if m is None else m for p, m in zip(params, means)]  # the AdamW path's
    return params


class _AdamW:
    """SignMuon's ``non_matrix="adamw"`` path by torch's own AdamW: each bias steps on the mean
    of every worker's gradient (zeros where a worker has none, as DDP adds them)."""

    def __init__(self, config: Config, params: list[torch.Tensor], hyper) -> None:
        self.on = [config.non_matrix == "adamw" and p.dim() < 2 for p in params]
        self.leaves = [torch.nn.Parameter(p.clone()) if on else None for p, on in zip(params, self.on)]
        self.optimizers = [
            torch.optim.AdamW([leaf], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd) if leaf is not None else None
            for leaf, (lr, wd) in zip(self.leaves, hyper)
        ]

    def step(self, params, grads: dict, workers) -> list[torch.Tensor | None]:
        """Each AdamW parameter's new value (None for the voted ones)."""
        out = []
        for i, (leaf, opt) in enumerate(zip(self.leaves, self.optimizers)):
            if leaf is None:
                out.append(None)
                continue
            present = [grads[w][i] for w in workers if grads[w] and grads[w][i] is not None]
            total = torch.zeros_like(params[i])
            for g in present:
                total = total + g
            leaf.grad = total / len(workers)
            opt.step()
            out.append(leaf.detach().clone())
        return out


def simulate(config: Config, world_size: int) -> list[list[torch.Tensor]]:
    """Every rank's final parameters by the definition: each group votes alone."""
    groups = config.groups or (tuple(range(world_size)),)
    finals = {}
    for workers in groups:
        result = _simulate_group(config, workers)
        finals.update({w: result for w in workers})
    return [finals[r] for r in range(world_size)]
