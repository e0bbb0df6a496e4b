"""What the hook is handed beyond plain backwards: DDP's per-parameter Python reducer (what
compiled autograd uses), real compiled autograd, parameters frozen and unfrozen later."""

from __future__ import annotations

from functools import partial

from torch.nn.parallel import DistributedDataParallel as DDP

from .cells import Cell
from .ddp_world import ENTRIES, HOOKED, Config, Net, backward, batch, ddp_cell, hooked, make_optimizer, simulate


def _python_reducer(rank: int, world_size: int, entry: str):
    """DDP built under ``optimize_ddp="python_reducer"`` (what compiled autograd's DDP uses): its
    per-parameter hooks call the comm hook with ``(grad, param)`` and drop what it returns."""
    import torch._dynamo

    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        net = Net()
        model = DDP(net)
        opt = hooked(entry, net, model)
        for step in range(2):
            opt.zero_grad()
            backward(model, rank, step, 0, True)
            opt.step()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        torch._dynamo.config.optimize_ddp = before


def _compiled_autograd(rank: int, world_size: int, entry: str):
    """A real compiled autograd run: DDP built under ``optimize_ddp="python_reducer"`` (torch
    refuses compiled autograd over the C++ reducer), a step whose forward and backward are
    ``torch.compile(backend="aot_eager")``-d with ``torch._dynamo.config.compiled_autograd``."""
    import torch._dynamo

    config = torch._dynamo.config
    before = config.optimize_ddp, config.compiled_autograd
    config.optimize_ddp = "python_reducer"
    try:
        net = Net()
        model = DDP(net)
        opt = hooked(entry, net, model)
        config.compiled_autograd = True

        @torch.compile(backend="aot_eager")
        def forward_backward(x, y):
            torch.nn.functional.cross_entropy(model(x, True), y).backward()

        for step in range(2):
            opt.zero_grad()
            forward_backward(*batch(rank, step, 0))
            opt.step()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        config.optimize_ddp, config.compiled_autograd = before
        torch._dynamo.reset()  # the next cells run uncompiled


def _compiled_in_step(rank: int, world_size: int, config: Config):
    """The refusal's remedy under compiled autograd: no DDP, ``vote_in_step=True``, forward and
    backward ``torch.compile(backend="aot_eager")``-d with ``compiled_autograd``."""
    import torch._dynamo

    torch.set_num_threads(1)
    net = Net()
    opt = make_optimizer(config, net, None)
    for p in net.parameters():  # what DDP's start-up broadcast gives: rank 0's weights
        torch.distributed.broadcast(p.data, 0)
    torch._dynamo.config.compiled_autograd = True
    try:

        @torch.compile(backend="aot_eager")
        def forward_backward(x, y):
            torch.nn.functional.cross_entropy(net(x, True), y).backward()

        for step in range(config.steps[rank]):
            opt.zero_grad()
            forward_backward(*batch(rank, step, 0))
            opt.step()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()


def _unfrozen_later(rank: int, world_size: int, entry: str):
    """The head frozen when DDP is built, unfrozen after the first step: DDP never reduces it."""
    net = Net()
    net.extra.requires_grad_(False)
    model = DDP(net)
    opt = hooked(entry, net, model)
    for step in range(3):
        if step == 1:
            net.extra.requires_grad_(True)
        opt.zero_grad()
        backward(model, rank, step, 0, True)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def handed_cells() -> list[Cell]:
    """The bare hook is left out of the unfrozen cells: DDP itself never reduces a parameter
    unfrozen after it was built."""
    cells = []
    for entry in ("SignumMV", "SignSGDMV", "hook-signsgd", "hook-signum"):  # SignMuon's: refusal_cells
        cells.append(
            ddp_cell(
                "what the hook is handed",
                "a second backward before step() without no_sync",
                Config(entry, (3, 3), micro=2, sync_every_micro=True),
                refusal="accumulate micro-batches with their forward and backward under ddp_model.no_sync()",
            )
        )
    for entry in ("hook-signsgd", "hook-signum"):  # the refusal above must not catch zeroed gradients
        cells.append(
            ddp_cell(
                "what the hook is handed",
                "zero_grad(set_to_none=False) between steps",
                Config(entry, (3, 3), set_to_none=False),
            )
        )
    for entry in HOOKED:
        cells.append(
            Cell(
                ENTRIES[entry],
                "what the hook is handed",
                "compiled autograd's per-parameter Python reducer (optimize_ddp='python_reducer')",
                partial(_python_reducer, entry=entry),
                refusal="optimize_ddp left at its default",
            )
        )
    for entry in ("SignumMV", "hook-signsgd"):
        cells.append(
            Cell(
                ENTRIES[entry],
                "what the hook is handed",
                "torch.compile(backend='aot_eager') with compiled_autograd=True over DDP's python_reducer: "
                "refused on every rank",
                partial(_compiled_autograd, entry=entry),
                refusal="optimize_ddp left at its default",
            )
        )
    compiled = Config("SignumMV-in-step", (2, 2))
    cells.append(
        Cell(
            ENTRIES[compiled.entry],
            "what the hook is handed",
            "the remedy: torch.compile(backend='aot_eager') with compiled_autograd=True, no DDP",
            partial(_compiled_in_step, config=compiled),
            partial(simulate, compiled),
            per_rank=True,
        )
    )
    for entry in HOOKED[2:]:
        cells.append(
            Cell(
                ENTRIES[entry],
                "who has a gradient",
                "a head frozen when DDP is built, unfrozen after step 1: refused naming requires_grad",
                partial(_unfrozen_later, entry=entry),
                refusal="Set requires_grad before building DDP",
            )
        )
    return cells
