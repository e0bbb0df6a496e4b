"""What runs after the hook, through the frameworks' own mixed precision: Lightning's
``precision="16-mixed"`` (its GradScaler, unscaled before its clipping) and ``"bf16-mixed"``,
and Accelerate with a GradScaler (what ``mixed_precision="fp16"`` makes on a GPU; on the CPU
Accelerate makes none, so the cell hands it one). Each rank's batches are those of
:mod:`.scaler_world`, so every cell equals its single-process reference there."""

from __future__ import annotations

from functools import partial

import torch

from .cells import Cell
from .ddp_world import Net, batch
from .scaler_world import KLASS, STEPS, ScalerConfig, loss_of, optimizer_of, simulate

ROWS = 5  # batch rows, as ddp_world's batches


class _Stream(torch.utils.data.Dataset):
    """Samples laid out so that rank r's step s is ``batch(r, s, 0)`` under the framework's sharding:
    ``"sampler"`` (Lightning's DistributedSampler: sample 2k + r is rank r's k-th) or ``"batches"``
    (Accelerate's: loader batch 2s + r is rank r's s-th)."""

    def __init__(self, sharding: str) -> None:
        self.sharding = sharding

    def __len__(self) -> int:
        return 2 * STEPS * ROWS

    def __getitem__(self, i: int):
        if self.sharding == "sampler":
            rank, k = i % 2, i // 2
        else:
            rank, k = (i // ROWS) % 2, (i // (2 * ROWS)) * ROWS + i % ROWS
        x, y = batch(rank, k // ROWS, 0)
        return x[k % ROWS], y[k % ROWS]


def lightning(rank: int, world_size: int, config: ScalerConfig, precision: str, kind: str) -> dict:
    """``Trainer.fit`` under ``precision`` (what ``Trainer(precision=...)`` makes on a GPU: on a CPU
    it turns "16-mixed" into bf16) with ``gradient_clip_val=0.1``; ``kind`` "hook" is the bare hook."""
    import os

    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from signmuon.comm_hooks import SignVoteState
    from signmuon.integrations.lightning import SignDDPStrategy

    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.made, self.hooks = Net(), None, []

        def training_step(self, batch_, index):
            loss, self.hooks = loss_of(config, self.net, self.net, self.global_rank, index)
            return loss

        def on_after_backward(self):
            for hook in self.hooks:
                hook.remove()

        def configure_optimizers(self):
            self.made = (
                torch.optim.SGD(self.parameters(), lr=0.01) if kind == "hook" else optimizer_of(config, self.net)
            )
            return self.made

    module = Module()
    strategy = SignDDPStrategy(comm_state=SignVoteState() if kind == "hook" else None, bucket_cap_mb=config.bucket_mb)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        plugins=[MixedPrecision(precision, "cpu")],  # Trainer(precision="16-mixed") turns bf16 on a CPU
        max_epochs=1,
        gradient_clip_val=None if kind == "hook" else 0.1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    saved = dict(os.environ)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(_Stream("sampler"), batch_size=ROWS))
    finally:  # Lightning's launch edits the environment a later Accelerator reads
        os.environ.clear()
        os.environ.update(saved)
    scaler = trainer.precision_plugin.scaler if hasattr(trainer.precision_plugin, "scaler") else None
    return {
        "parameters": [p.detach().clone() for p in module.net.parameters()],
        "scale": None if scaler is None else scaler.get_scale(),
        "optimizer steps": module.made.steps_taken,
    }


def accelerate(rank: int, world_size: int, config: ScalerConfig, kind: str) -> dict:
    """Accelerate's loop with ``accelerator.clip_grad_norm_(0.1)`` under a GradScaler; also the
    steps Accelerate saw skipped (``optimizer.step_was_skipped``, what its scheduler follows)."""
    from accelerate import Accelerator

    from signmuon.comm_hooks import SignVoteState
    from signmuon.integrations.accelerate import register_comm_hook

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler(
        "cpu", init_scale=config.init_scale, growth_interval=config.growth_interval
    )
    net = Net()
    made = torch.optim.SGD(net.parameters(), lr=0.01) if kind == "hook" else optimizer_of(config, net)
    loader = torch.utils.data.DataLoader(_Stream("batches"), batch_size=ROWS)
    model, optimizer, loader = accelerator.prepare(net, made, loader)
    register_comm_hook(accelerator, model, optimizer, comm_state=SignVoteState() if kind == "hook" else None)
    skipped = []
    for step, _ in enumerate(loader):
        optimizer.zero_grad()
        loss, hooks = loss_of(config, model, net, rank, step)
        accelerator.backward(loss)
        for hook in hooks:
            hook.remove()
        accelerator.clip_grad_norm_(net.parameters(), 0.1)
        optimizer.step()
        if optimizer.step_was_skipped:
            skipped.append(step)
    return {
        "parameters": [p.detach().clone() for p in net.parameters()],
        "scale": accelerator.scaler.get_scale(),
        "optimizer steps": made.steps_taken,
        "steps Accelerate saw skipped": skipped,
    }


def _with_skipped(config: ScalerConfig, world_size: int) -> dict:
    return {**simulate(config, world_size), "steps Accelerate saw skipped": sorted({s for _, s, _ in config.bad})}


def framework_scaler_cells() -> list[Cell]:
    """Lightning, Accelerate and the HF Trainer under mixed precision (run before the resume cells,
    whose Lightning fits leave the environment edited)."""
    nan_at_1 = ((0, 1, "all"),)
    cells = []
    for kind in ("SignumMV", "SignMuon"):
        atol = 1e-6 if kind == "SignMuon" else 0.0
        fp16 = ScalerConfig(kind, bad=nan_at_1, autocast="float16", init_scale=2.0**16, growth_interval=2000)
        case = f"{kind}, precision='16-mixed', gradient_clip_val=0.1, every gradient NaN on rank 0 at step 1"
        run = partial(lightning, config=fp16, precision="16-mixed", kind=kind)
        cells.append(Cell("Lightning", KLASS, case, run, partial(simulate, fp16), atol=atol))
        scaled = ScalerConfig(kind, bad=((0, 1, "all"), (1, 4, "extra.bias")))
        case = (
            f"{kind}, a GradScaler (fp16's on a GPU), clip_grad_norm_(0.1), NaN on rank 0 at step 1, Inf on rank 1 at 4"
        )
        run = partial(accelerate, config=scaled, kind=kind)
        cells.append(Cell("Accelerate", KLASS, case, run, partial(_with_skipped, scaled), atol=atol))
    bf16 = ScalerConfig("SignumMV", bad=((1, 2, "extra.weight"),), scaler=False, autocast="bfloat16", bucket_mb=1e-5)
    case = (
        "SignumMV, precision='bf16-mixed', tiny buckets, one gradient Inf on rank 1 at step 2: that step moves nothing"
    )
    run = partial(lightning, config=bf16, precision="bf16-mixed", kind="SignumMV")
    cells.append(Cell("Lightning", KLASS, case, run, partial(simulate, bf16)))
    refusal = "with the bare sign-vote hook: GradScaler divides the voted"
    cells.append(
        Cell(
            "Lightning",
            KLASS,
            "sign_vote_hook (SignVoteState) with SGD under precision='16-mixed': refused on every rank",
            partial(lightning, config=ScalerConfig("SignumMV"), precision="16-mixed", kind="hook"),
            refusal=refusal,
        )
    )
    cells.append(
        Cell(
            "Accelerate",
            KLASS,
            "sign_vote_hook (SignVoteState) with SGD under a GradScaler: refused on every rank",
            partial(accelerate, config=ScalerConfig("SignumMV"), kind="hook"),
            refusal=refusal,
        )
    )
    return hf_cells() + cells  # the HF Trainer first: Lightning's launch leaves the environment Accelerate reads


def _gpt2_fit(kind: str, output_dir: str, scaler: bool) -> list[torch.Tensor]:
    """A 1-layer GPT-2 from a config through SignTrainer (6 steps, ``max_grad_norm`` 1.0), with a
    GradScaler handed to its Accelerator (what fp16 makes on a GPU) whose scale doubles every 2 steps."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from signmuon.integrations.transformers import SignTrainer

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    ids = [(torch.arange(16) * 3 + i % 8) % 32 for i in range(64)]
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    spec = {"type": kind, "params": {"momentum": 0.9} if kind == "SignumMV" else {}}
    data = [{"input_ids": t, "labels": t} for t in ids]
    trainer = SignTrainer(model=model, args=args, train_dataset=data, sign_optimizer=spec)
    if scaler:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def hf_trainer(rank: int, world_size: int, kind: str) -> dict:
    """The fit under a GradScaler against the same fit without one, in this spawn."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        scaled, plain = _gpt2_fit(kind, folder, True), _gpt2_fit(kind, folder, False)
    return {
        "entries that differ from the fit without a scaler": sum(int((a != b).sum()) for a, b in zip(scaled, plain))
    }


def _none_differ(world_size: int) -> dict:
    return {"entries that differ from the fit without a scaler": 0}


def hf_cells() -> list[Cell]:
    return [
        Cell(
            "HF Trainer",
            KLASS,
            f"{kind}, a GradScaler (fp16's on a GPU) whose scale doubles every 2 steps = the fit without one",
            partial(hf_trainer, kind=kind),
            _none_differ,
        )
        for kind in ("SignumMV", "SignMuon")
    ]
