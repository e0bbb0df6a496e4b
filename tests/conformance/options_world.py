"""Configurations :class:`.ddp_world.Config` does not express, each a run on every rank and its
single-process reference: SignMuon's ``non_matrix="adamw"`` over an Embedding (tokens some batch
never holds), a LayerNorm and a head; SignMuon on channels_last convolutions; two DDP models,
each with its own hook, backwards interleaved; and an optimizer state loaded into an optimizer
built with its parameters in another order."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.optim import SignMuon, SignumMV, muon_param_groups
from signmuon.optim.newton_schulz import as_matrix, newton_schulz

from .cells import Cell
from .ddp_world import BETA, ENTRIES, EXACT, LR, Config, Net, backward, hooked, simulate

STEPS = 3
ADAMW_LR, WD = 0.003, 0.1


def _model(net: nn.Module, opt, in_step: bool):
    """DDP with ``opt``'s hook, or the bare net with rank 0's weights (what DDP's broadcast gives)."""
    if in_step:
        for p in net.parameters():
            dist.broadcast(p.data, 0)
        return net
    model = DDP(net)
    opt.register_comm_hook(model)
    return model


def _copy(make, params: list[torch.Tensor]) -> nn.Module:
    net = make()
    with torch.no_grad():
        for p, v in zip(net.parameters(), params):
            p.copy_(v)
    return net


def _muon_direction(grad, momentum):
    """SignMuon's per-worker direction, advancing ``momentum``: Nesterov look, then Newton–Schulz."""
    momentum.lerp_(grad, 1 - BETA)
    look = grad.lerp(momentum, BETA)
    return newton_schulz(as_matrix(look), 5).view_as(look) if look.dim() >= 2 else look


def _vote(directions):
    return torch.sign(sum(torch.sign(d) for d in directions))


# --- SignMuon, non_matrix="adamw", an Embedding ---------------------------------------------------


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(11, 6), nn.Linear(6, 8)
        self.ln, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(torch.tanh(self.fc(self.emb(t)))).mean(1))


def _token_loss(model, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens, y = torch.randint(0, 7, (4, 5), generator=gen), torch.randint(0, 3, (4,), generator=gen)  # 7..10 absent
    nn.functional.cross_entropy(model(tokens), y).backward()


def adamw_train(rank: int, world_size: int, in_step: bool) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    net = Tokens()
    opt = SignMuon(
        muon_param_groups(net),
        lr=LR,
        momentum=BETA,
        weight_decay=WD,
        non_matrix="adamw",
        adamw_lr=ADAMW_LR,
        vote=EXACT,
        vote_in_step=in_step,
    )
    model = _model(net, opt, in_step)
    for step in range(STEPS):
        opt.zero_grad()
        _token_loss(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def adamw_reference(world_size: int) -> list[torch.Tensor]:
    """What muon_param_groups routes to the vote voted with decoupled decay; the rest AdamW
    (betas 0.9, 0.95, eps 1e-8, the same decay) on the workers' mean gradient at ``adamw_lr``."""
    torch.set_num_threads(1)
    net = Tokens()
    muon = {id(p) for p in muon_param_groups(net)[0]["params"]}
    is_muon = [id(p) in muon for p in net.parameters()]
    params = [p.detach().clone() for p in net.parameters()]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    first, second = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        grads = []
        for w in range(world_size):
            copy = _copy(Tokens, params)
            _token_loss(copy, w, step)
            grads.append([p.grad.clone() for p in copy.parameters()])
        new = []
        for i, p in enumerate(params):
            if is_muon[i]:
                vote = _vote([_muon_direction(grads[w][i], momenta[w][i]) for w in range(world_size)])
                new.append(p * (1 - LR * WD) - LR * vote)
                continue
            g, t = sum(grads[w][i] for w in range(world_size)) / world_size, step + 1
            first[i], second[i] = first[i].lerp(g, 0.1), second[i] * 0.95 + 0.05 * g * g
            denom = second[i].sqrt() / math.sqrt(1 - 0.95**t) + 1e-8
            new.append(p * (1 - ADAMW_LR * WD) - ADAMW_LR / (1 - 0.9**t) * first[i] / denom)
        params = new
    return params


# --- SignMuon on channels_last convolutions -------------------------------------------------------


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.conv2, self.fc = nn.Conv2d(3, 5, 3), nn.Conv2d(5, 4, 2), nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv2(torch.tanh(self.conv(x)))).flatten(1))


def _image_loss(model, rank: int, step: int, channels_last: bool) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    nn.functional.cross_entropy(model(x), y).backward()


def channels_last_train(rank: int, world_size: int, in_step: bool) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    net = Convs().to(memory_format=torch.channels_last)
    opt = SignMuon(net.parameters(), lr=LR, momentum=BETA, vote=EXACT, vote_in_step=in_step)
    model = _model(net, opt, in_step)
    for step in range(STEPS):
        opt.zero_grad()
        _image_loss(model, rank, step, True)
        opt.step()
    return [p.detach().contiguous().clone() for p in net.parameters()]


def channels_last_reference(world_size: int) -> list[torch.Tensor]:
    """The definition on contiguous copies: as_matrix in logical (out, in * kh * kw) order."""
    torch.set_num_threads(1)
    params = [p.detach().clone() for p in Convs().parameters()]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    for step in range(STEPS):
        grads = []
        for w in range(world_size):
            copy = _copy(Convs, params)
            _image_loss(copy, w, step, False)
            grads.append([p.grad.clone() for p in copy.parameters()])
        votes = [
            _vote([_muon_direction(grads[w][i], momenta[w][i]) for w in range(world_size)]) for i in range(len(params))
        ]
        params = [p - LR * v for p, v in zip(params, votes)]
    return params


# --- two DDP models in one process, each with its own hook -----------------------------------------


def two_models_train(rank: int, world_size: int, entries: tuple[str, str]) -> list[list[torch.Tensor]]:
    """Both models' zero_grad, then both backwards, then both steps: each hook votes its own buckets."""
    torch.set_num_threads(1)
    nets = [Net() for _ in entries]
    models = [DDP(net) for net in nets]
    opts = [hooked(entry, net, model) for entry, net, model in zip(entries, nets, models)]
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        for model in models:
            backward(model, rank, step, 0, True)
        for opt in opts:
            opt.step()
    return [[p.detach().clone() for p in net.parameters()] for net in nets]


def two_models_reference(world_size: int, entries: tuple[str, str]) -> list:
    each = [simulate(Config(entry, (STEPS,) * world_size), world_size) for entry in entries]
    return [[finals[rank] for finals in each] for rank in range(world_size)]


# --- a state loaded into an optimizer built with its parameters in another order ------------------


def _reordered(net: Net, entry: str, order: str):
    params = list(net.parameters())
    if order == "reversed":  # shapes differ position by position
        params = params[::-1]
    elif order == "swap-biases":  # body.2.bias and extra.bias: the same shape (3,)
        params[3], params[5] = params[5], params[3]
    return (SignMuon if entry == "SignMuon" else SignumMV)(params, lr=LR, momentum=BETA, vote=EXACT)


def reordered_load(rank: int, world_size: int, entry: str, order: str) -> dict:
    """2 steps, state_dict, a fresh optimizer over another order loads it, 2 more steps; against
    the uninterrupted 4 steps in the same spawn, entries that differ."""
    torch.set_num_threads(1)

    def built(order: str):
        net = Net()
        model = DDP(net)
        opt = _reordered(net, entry, order)
        opt.register_comm_hook(model)
        return net, model, opt

    def train(model, opt, steps) -> None:
        for step in steps:
            opt.zero_grad()
            backward(model, rank, step, 0, True)
            opt.step()

    net, model, opt = built("plain")
    train(model, opt, range(2))
    saved = opt.state_dict()
    net2, model2, opt2 = built(order)
    with torch.no_grad():
        for a, b in zip(net2.parameters(), net.parameters()):
            a.copy_(b)
    opt2.load_state_dict(saved)
    train(model2, opt2, range(2, 4))
    train(model, opt, range(2, 4))
    differing = sum(int((a != b).sum()) for a, b in zip(net2.parameters(), net.parameters()))
    return {"entries that differ from the uninterrupted run": differing}


def _none_differ(world_size: int) -> dict:
    return {"entries that differ from the uninterrupted run": 0}


def option_cells() -> list[Cell]:
    cells = []
    for in_step, entry in ((False, "SignMuon"), (True, "SignMuon-in-step")):
        cells += [
            Cell(
                ENTRIES[entry],
                "what the optimizer holds",
                "muon_param_groups, non_matrix='adamw', weight_decay: an Embedding with absent tokens, "
                "a LayerNorm and a head in AdamW",
                partial(adamw_train, in_step=in_step),
                adamw_reference,
                atol=1e-6,
            ),
            Cell(
                ENTRIES[entry],
                "what the hook is handed",
                "channels_last convolutions: their gradients strided NHWC",
                partial(channels_last_train, in_step=in_step),
                channels_last_reference,
                atol=1e-6,
            ),
        ]
    for entries in (("SignumMV", "SignMuon"), ("SignMuon", "hook-signsgd"), ("hook-signsgd", "SignumMV")):
        cells.append(
            Cell(
                ENTRIES[entries[0]],
                "what the hook is handed",
                f"two DDP models in one process, the other with {ENTRIES[entries[1]]}, backwards interleaved",
                partial(two_models_train, entries=entries),
                partial(two_models_reference, entries=entries),
                atol=1e-6 if "SignMuon" in entries else 0.0,
                per_rank=True,
            )
        )
    for entry in ("SignumMV", "SignMuon"):
        cells += [
            Cell(
                ENTRIES[entry],
                "whose state comes back",
                "load_state_dict into an optimizer built with two same-shape biases swapped "
                "= the uninterrupted run in the same spawn",
                partial(reordered_load, entry=entry, order="swap-biases"),
                _none_differ,
            ),
            Cell(
                ENTRIES[entry],
                "whose state comes back",
                "load_state_dict into an optimizer built with its parameters reversed: refused naming the shape",
                partial(reordered_load, entry=entry, order="reversed"),
                refusal="expected shape",
            ),
        ]
    return cells
