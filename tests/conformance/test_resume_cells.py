"""Conformance of resuming ("whose state comes back"): each rank's momentum is its own, so a
resumed run must give every rank its own back, bit for bit, and a rank handed another rank's
momentum (every rank loading rank 0's file, the usual DDP habit) must be refused on every rank
with the remedy, not train on silently.

Plain DDP and ``vote_in_step`` cells save a file per rank with ``torch.save`` (or one file with
``checkpoint_all_ranks=True``); the framework cells resume through the framework's own entry
point (``Trainer.train(resume_from_checkpoint=...)``, Lightning's ``fit(ckpt_path=...)``,
``accelerator.save_state`` / ``load_state``). SignumMV's resumed parameters equal the
single-process reference of :mod:`.ddp_world` bit for bit; SignMuon's Newton–Schulz differs from
it in the last bits between processes, so SignMuon cells, and every framework cell, count the
entries (parameters and optimizer state) where the resumed run differs from the uninterrupted
run of the same configuration in the same spawn, on each rank: none may.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import VoteConfig
from signmuon.optim import LocalStepAverager, SignMuon, SignumMV
from signmuon.optim.checkpoint import refuse_load

from . import accumulation_frameworks, hf_frameworks, scaler_frameworks
from .cells import Cell, check_cells
from .ddp_world import BETA, ENTRIES, EXACT, LR, Config, Net, backward, simulate

KLASS = "whose state comes back"
STEPS, SAVED_AT = 4, 2
DIFFERING = "entries that differ from the uninterrupted run (parameters, optimizer state)"
REMEDY = "or create the optimizer with checkpoint_all_ranks=True"


# --- shared mechanics ----------------------------------------------------------------------------


@contextmanager
def _shared_folder():
    """A temporary folder every rank of the spawn writes into (rank 0 makes and removes it)."""
    made = [tempfile.mkdtemp(prefix="signmuon-resume-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    try:
        yield made[0]
    finally:
        dist.barrier()  # every rank is done with the files
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)


def _tensors(params, optimizer) -> list[torch.Tensor]:
    """Parameters, then every tensor of the optimizer's state, in a fixed order."""
    state = [v for p in params for _, v in sorted(optimizer.state[p].items()) if torch.is_tensor(v)]
    return [p.detach() for p in params] + [v.detach() for v in state]


def _differing(resumed: list[torch.Tensor], whole: list[torch.Tensor]) -> dict:
    """How many entries differ (bit for bit: an exact difference is zero only where equal)."""
    if [t.shape for t in resumed] != [t.shape for t in whole]:
        return {DIFFERING: f"shapes {[tuple(t.shape) for t in resumed]} vs {[tuple(t.shape) for t in whole]}"}
    return {DIFFERING: sum(int((a != b).sum()) for a, b in zip(resumed, whole))}


def _none_differ(world_size: int, steps: int) -> dict:
    return {DIFFERING: 0, "optimizer steps": steps}


# --- plain DDP hook and vote_in_step: torch.save ---------------------------------------------------


def _build(entry: str, all_ranks: bool, vote: VoteConfig = EXACT):
    """The net, the model to call, and the optimizer of ``entry`` (a key of ENTRIES), as a fresh process builds them."""
    net = Net()
    in_step = entry.endswith("in-step")
    options = dict(vote=vote, vote_in_step=in_step, checkpoint_all_ranks=all_ranks)
    make = SignMuon if entry.startswith("SignMuon") else SignumMV
    opt = make(net.parameters(), lr=LR, momentum=BETA, **options)
    if in_step:
        return net, net, opt
    model = DDP(net)
    opt.register_comm_hook(model)
    return net, model, opt


def _train(rank: int, model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        backward(model, rank, step, 0, True)
        opt.step()


def _resumed(rank: int, entry: str, how: str, folder: str, vote: VoteConfig):
    """Train SAVED_AT steps, save, build everything anew, load, train to STEPS. ``how``: "per rank"
    (each rank's own file), "all ranks" (checkpoint_all_ranks: rank 0's file holds everyone's),
    "rank 0's" (rank 0's file alone, loaded by every rank)."""
    all_ranks = how == "all ranks"
    net, model, opt = _build(entry, all_ranks, vote)
    _train(rank, model, opt, range(SAVED_AT))
    saved = {"model": net.state_dict(), "optimizer": opt.state_dict()}  # a collective with all_ranks
    writer = rank if how == "per rank" else 0
    path = os.path.join(folder, f"rank{writer}.pt")
    if rank == writer:
        torch.save(saved, path)
    dist.barrier()  # the file is written before anyone reads it
    net, model, opt = _build(entry, all_ranks, vote)
    loaded = torch.load(path, weights_only=True)
    net.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    _train(rank, model, opt, range(SAVED_AT, STEPS))
    return net, opt


def resume_params(rank: int, world_size: int, entry: str, how: str, vote: VoteConfig = EXACT) -> list[torch.Tensor]:
    """The resumed run's final parameters."""
    with _shared_folder() as folder:
        net, _ = _resumed(rank, entry, how, folder, vote)
    return [p.detach().clone() for p in net.parameters()]


def resume_vs_whole(rank: int, world_size: int, entry: str, how: str, vote: VoteConfig = EXACT) -> dict:
    """Entries where the resumed run differs from the uninterrupted one, and its step count."""
    with _shared_folder() as folder:
        net, opt = _resumed(rank, entry, how, folder, vote)
    whole_net, whole_model, whole_opt = _build(entry, how == "all ranks", vote)
    _train(rank, whole_model, whole_opt, range(STEPS))
    params, whole = list(net.parameters()), list(whole_net.parameters())
    return {**_differing(_tensors(params, opt), _tensors(whole, whole_opt)), "optimizer steps": opt.steps_taken}


def missing_file(rank: int, world_size: int, entry: str) -> None:
    """Each rank saves its own file; rank 1's is lost. Rank 1 calls refuse_load (what an
    integration does when it finds no file), rank 0 loads its own: both must raise."""
    with _shared_folder() as folder:
        net, model, opt = _build(entry, False)
        _train(rank, model, opt, range(SAVED_AT))
        path = os.path.join(folder, f"rank{rank}.pt")
        torch.save(opt.state_dict(), path)
        dist.barrier()
        if rank == 1:
            os.remove(path)
        net, model, opt = _build(entry, False)
        if not os.path.exists(path):
            refuse_load(opt, FileNotFoundError(f"{path} is missing: rank {rank} cannot load its optimizer state"))
        opt.load_state_dict(torch.load(path, weights_only=True))


SAME_SPAWN = "= the uninterrupted run in the same spawn"


def resume_cells() -> list[Cell]:
    cells = []
    for entry in ("SignumMV", "SignumMV-in-step"):
        for how, case in (
            ("per rank", "torch.save per rank after 2 of 4 steps, each rank loads its own"),
            ("all ranks", "checkpoint_all_ranks=True: rank 0's one file, each rank loads its part"),
        ):
            run = partial(resume_params, entry=entry, how=how)
            reference = partial(simulate, Config(entry, (STEPS,) * 2))
            cells.append(Cell(ENTRIES[entry], KLASS, case, run, reference, per_rank=True))
    for entry in ("SignMuon", "SignMuon-in-step"):
        for how, case in (
            ("per rank", f"torch.save per rank after 2 of 4 steps {SAME_SPAWN}"),
            ("all ranks", f"checkpoint_all_ranks=True, one file {SAME_SPAWN}"),
        ):
            run = partial(resume_vs_whole, entry=entry, how=how)
            cells.append(Cell(ENTRIES[entry], KLASS, case, run, partial(_none_differ, steps=STEPS)))
    for entry in ("SignumMV", "SignMuon", "SignumMV-in-step"):
        run = partial(resume_params, entry=entry, how="rank 0's")
        case = "every rank loads rank 0's file: refused on every rank, naming the remedy"
        cells.append(Cell(ENTRIES[entry], KLASS, case, run, refusal=REMEDY))
    case = "rank 1's file is missing (refuse_load there): refused on every rank, none waits"
    cells.append(Cell(ENTRIES["SignumMV"], KLASS, case, partial(missing_file, entry="SignumMV"), refusal="cannot load"))
    return cells


NODE_AWARE = VoteConfig(tie="exact", hierarchical=True, ranks_per_node=2)


def node_aware_cells() -> list[Cell]:
    """2 nodes x 2 ranks: each local rank holds its slice (SignumMV) or its owned matrices (SignMuon)."""
    cells = []
    for entry in ("SignumMV", "SignMuon"):
        for how, case in (
            ("per rank", f"node-aware 2 x 2, torch.save per rank {SAME_SPAWN}"),
            ("all ranks", f"node-aware 2 x 2, checkpoint_all_ranks=True {SAME_SPAWN}"),
        ):
            run = partial(resume_vs_whole, entry=entry, how=how, vote=NODE_AWARE)
            cells.append(Cell(ENTRIES[entry], KLASS, case, run, partial(_none_differ, steps=STEPS)))
        run = partial(resume_params, entry=entry, how="rank 0's", vote=NODE_AWARE)
        case = "node-aware 2 x 2, every rank loads rank 0's file: refused on every rank"
        cells.append(Cell(ENTRIES[entry], KLASS, case, run, refusal=REMEDY))
    return cells


# --- frameworks: their own save and resume entry points ----------------------------------------------

FIT_STEPS = 6  # each framework run: 6 optimizer steps, saved after 3


def _optimizer(kind: str, params):
    """``kind``: "SignMuon", "SignumMV", "hook" (torch's SGD applying the bare sign-vote hook's
    vote) or "averager" (torch's SGD, local steps averaged by a LocalStepAverager)."""
    if kind in ("hook", "averager"):
        return torch.optim.SGD(params, lr=0.02)
    return SignMuon(params, lr=0.02) if kind == "SignMuon" else SignumMV(params, lr=0.02, momentum=0.9)


def _hook_state(kind: str):
    from signmuon.comm_hooks import SignVoteState

    return SignVoteState(momentum=0.9) if kind == "hook" else None


def _outcome(params, opt, hook) -> tuple[list[torch.Tensor], int]:
    """What a run ends with: parameters, optimizer state and the hook's momentum; its step count."""
    if hook is None:
        return _tensors(params, opt), opt.steps_taken
    momentum = hook.state_dict()["momentum"]
    return [p.detach() for p in params] + [momentum[k] for k in sorted(momentum)], hook.iter


def _compare(resumed: tuple, whole: tuple) -> dict:
    return {**_differing(resumed[0], whole[0]), "optimizer steps": resumed[1]}


def _data(n: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1000)
    x = torch.randn(n, 6, generator=gen)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def _tiny_gpt2():
    """A 1-layer GPT-2 from a config, nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        start = int(torch.randint(0, 8, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (torch.arange(16) * 3 + start) % 32
        return {"input_ids": ids, "labels": ids}


def _hf_fit(kind: str, output_dir: str, resume: str | None):
    from transformers import TrainingArguments

    from signmuon.integrations.transformers import SignTrainer, _innermost

    model = _tiny_gpt2()
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=FIT_STEPS,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        save_strategy="steps",
        save_steps=FIT_STEPS // 2,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    spec = {"type": kind, "params": {"momentum": 0.9} if kind == "SignumMV" else {}}
    trainer = SignTrainer(model=model, args=args, train_dataset=_Tokens(), sign_optimizer=spec)
    trainer.train(resume_from_checkpoint=resume)
    return _outcome(list(model.parameters()), _innermost(trainer.optimizer), None)


def hf_trainer(rank: int, world_size: int, kind: str) -> dict:
    """Uninterrupted (saving at step 3 on the way), then resumed from that checkpoint by a new Trainer."""
    with _shared_folder() as folder:
        whole = _hf_fit(kind, os.path.join(folder, "whole"), None)
        checkpoint = os.path.join(folder, "whole", f"checkpoint-{FIT_STEPS // 2}")
        return _compare(_hf_fit(kind, os.path.join(folder, "resumed"), checkpoint), whole)


def _lightning_fit(kind: str, folder: str, resume: str | None):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from signmuon.integrations.lightning import SignDDPStrategy

    from ..harness import tiny_net

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_net()
            self.made = None

        def training_step(self, batch, _):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            self.made = _optimizer(kind, self.parameters())
            return self.made

    module = Net()
    loader = torch.utils.data.DataLoader(_data(48), batch_size=8)  # 3 batches per rank and epoch
    hook = _hook_state(kind)
    # a round every 2 steps: the checkpoint at step 3 falls between rounds, where the workers differ
    averager = LocalStepAverager(period=2, pull=0.5) if kind == "averager" else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=SignDDPStrategy(comm_state=hook, averager=averager),
        max_epochs=FIT_STEPS // 3,
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    if averager is not None:
        return [p.detach() for p in module.parameters()], averager.step
    return _outcome(list(module.parameters()), module.made, hook)


def lightning(rank: int, world_size: int, kind: str) -> dict:
    """Uninterrupted (ModelCheckpoint after each epoch of 3 steps), then fit(ckpt_path=) from the first."""
    os.environ["NODE_RANK"] = "0"
    with _shared_folder() as folder:
        whole = _lightning_fit(kind, os.path.join(folder, "whole"), None)
        first = os.path.join(folder, "whole", f"epoch=0-step={FIT_STEPS // 2}.ckpt")
        return _compare(_lightning_fit(kind, os.path.join(folder, "resumed"), first), whole)


def _accelerate_fit(kind: str, folder: str, resume: bool):
    from accelerate import Accelerator

    from signmuon.integrations.accelerate import register_comm_hook

    from ..harness import tiny_net

    accelerator = Accelerator(cpu=True)
    net = tiny_net()
    loader = torch.utils.data.DataLoader(_data(96), batch_size=8)  # 6 batches per rank
    model, optimizer, loader = accelerator.prepare(net, _optimizer(kind, net.parameters()), loader)
    hook = _hook_state(kind)
    register_comm_hook(accelerator, model, optimizer, comm_state=hook)
    start = FIT_STEPS // 2 if resume else 0
    if resume:
        accelerator.load_state(folder)
    for step, (x, y) in enumerate(accelerator.skip_first_batches(loader, start), start):
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        if step + 1 == FIT_STEPS // 2 and not resume:
            accelerator.save_state(folder)
    return _outcome(list(net.parameters()), optimizer.optimizer, hook)


def accelerate(rank: int, world_size: int, kind: str) -> dict:
    """Uninterrupted (save_state after 3 steps on the way), then load_state and the last 3 steps."""
    with _shared_folder() as folder:
        whole = _accelerate_fit(kind, folder, resume=False)
        return _compare(_accelerate_fit(kind, folder, resume=True), whole)


def framework_cells() -> list[Cell]:
    cells = []
    for entry, run, how in (
        ("HF Trainer", hf_trainer, "train(resume_from_checkpoint=) at step 3 of 6"),
        ("Lightning", lightning, "fit(ckpt_path=) from ModelCheckpoint's epoch 1 of 2"),
        ("Accelerate", accelerate, "save_state at step 3 of 6, load_state"),
    ):
        kinds = ("SignumMV", "SignMuon") + (("hook",) if entry != "HF Trainer" else ())
        for kind in kinds + (("averager",) if entry == "Lightning" else ()):
            name = {"hook": "sign_vote_hook (SignVoteState) with SGD", "averager": "LocalStepAverager with SGD"}
            name = name.get(kind, kind)
            case = f"{name}, {how} {SAME_SPAWN}"
            cells.append(Cell(entry, KLASS, case, partial(run, kind=kind), partial(_none_differ, steps=FIT_STEPS)))
    return cells


def test_each_rank_resumes_its_own_momentum():
    check_cells(resume_cells(), 2)


def test_node_aware_ranks_resume_their_own_slices():
    check_cells(node_aware_cells(), 4)


def test_frameworks_resume_each_ranks_momentum():
    for extra in ("transformers", "lightning", "accelerate"):
        pytest.importorskip(extra, reason=f"the {extra} extra")
    cells = framework_checkpointing_cells() + framework_overflow_cells() + framework_accumulation_cells()
    check_cells(cells + framework_cells(), 2, timeout=600)


def framework_overflow_cells() -> list[Cell]:
    """What runs after the hook in the same spawn: the frameworks' GradScaler and bf16 (:mod:`.scaler_frameworks`)."""
    return scaler_frameworks.framework_scaler_cells()


def framework_accumulation_cells() -> list[Cell]:
    """What the hook is handed through Accelerate's and Lightning's accumulation, in the same spawn (:mod:`.accumulation_frameworks`)."""
    return accumulation_frameworks.accumulation_cells()


def framework_checkpointing_cells() -> list[Cell]:
    """What runs after the hook through the HF Trainer with activation checkpointing and clipping (:mod:`.hf_frameworks`)."""
    return hf_frameworks.checkpointing_cells()
