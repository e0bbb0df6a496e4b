"""What the hook is handed through the frameworks' own gradient accumulation: Accelerate's
``gradient_accumulation_steps=2`` with ``accelerator.accumulate(model)``, and Lightning's
``accumulate_grad_batches=2`` with ``gradient_clip_val=0.1`` (clipping after the vote leaves
SignumMV's and SignMuon's steps as they are). Either must vote once per step on the micro-batches'
sum: :mod:`.ddp_world`'s reference with ``micro=2`` (the frameworks' 1/2 loss scaling changes no
sign, and Newton–Schulz normalises first)."""

from __future__ import annotations

import os
from functools import partial

import torch

from .cells import Cell
from .ddp_world import Config, Net, batch, make_optimizer, simulate

STEPS = 3
KLASS = "what the hook is handed"


def accelerate(rank: int, world_size: int, kind: str) -> list[torch.Tensor]:
    from accelerate import Accelerator

    from signmuon.integrations.accelerate import register_comm_hook

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = Net()
    model, optimizer = accelerator.prepare(net, make_optimizer(Config(kind), net, None))
    register_comm_hook(accelerator, model, optimizer)
    for step in range(STEPS):
        for micro in range(2):
            with accelerator.accumulate(model):
                x, y = batch(rank, step, micro)
                accelerator.backward(torch.nn.functional.cross_entropy(model(x, True), y))
                optimizer.step()  # a no-op until the second micro-batch syncs
                optimizer.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


class _Indices(torch.utils.data.Dataset):
    """Placeholders: the training step makes rank r's micro-batch m of step s from its index."""

    def __len__(self) -> int:
        return 2 * 2 * STEPS

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(1)


def lightning(rank: int, world_size: int, kind: str) -> list[torch.Tensor]:
    import lightning.pytorch as pl

    from signmuon.integrations.lightning import SignDDPStrategy

    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, _, index):
            x, y = batch(self.global_rank, index // 2, index % 2)
            return torch.nn.functional.cross_entropy(self.net(x, True), y)

        def configure_optimizers(self):
            return make_optimizer(Config(kind), self.net, None)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=SignDDPStrategy(),
        max_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    saved = dict(os.environ)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(_Indices(), batch_size=1))
    finally:  # Lightning's launch edits the environment a later Accelerator reads
        os.environ.clear()
        os.environ.update(saved)
    return [p.detach().clone() for p in module.net.parameters()]


def accumulation_cells() -> list[Cell]:
    cells = []
    for entry, run, how in (
        ("Accelerate", accelerate, "gradient_accumulation_steps=2 under accelerator.accumulate(model)"),
        ("Lightning", lightning, "accumulate_grad_batches=2, gradient_clip_val=0.1"),
    ):
        for kind in ("SignumMV", "SignMuon"):
            reference = partial(simulate, Config(kind, (STEPS,) * 2, micro=2))
            atol = 1e-6 if kind == "SignMuon" else 0.0
            case = f"{kind}, {how}: voted once on the 2 micro-batches"
            cells.append(Cell(entry, KLASS, case, partial(run, kind=kind), reference, atol=atol, per_rank=True))
    return cells
