"""What runs after the hook through the HF Trainer: ``SignTrainer`` with activation (gradient)
checkpointing, ``max_grad_norm`` clipping that bites and weight decay, against the workers
simulated in a loop with plain GPT-2 (no checkpointing, no clipping: clipping after the vote
leaves the sign our optimizers take). The Trainer's sequential sampler gives rank r the loader's
batches r, r + 2, ... (Accelerate's sharding), so each worker's batches are known here."""

from __future__ import annotations

import tempfile
from functools import partial

import torch

from .cells import Cell

STEPS, ROWS, LR, WEIGHT_DECAY = 4, 4, 0.01, 0.1
BETAS = {"SignumMV": 0.9, "SignMuon": 0.95}  # the spec's momentum; SignMuon's default


def _gpt2():
    """Two GPT-2 blocks from a config. The attention's bias is frozen: its key part's gradient is
    rounding noise (softmax ignores a shift of every score), whose sign no reference can share."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(False)
    return model


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(7 + i))


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": _ids(i), "labels": _ids(i)}


def _batch(world_size: int, worker: int, index: int) -> torch.Tensor:
    """The worker's ``index``-th micro-batch: the loader's batch ``index * world_size + worker``."""
    return torch.stack([_ids((index * world_size + worker) * ROWS + j) for j in range(ROWS)])


def trainer_fit(rank: int, world_size: int, kind: str, accumulation: int) -> list[torch.Tensor]:
    from transformers import TrainingArguments

    from signmuon.comm_hooks import VoteConfig
    from signmuon.integrations.transformers import SignTrainer

    torch.set_num_threads(1)
    model = _gpt2()
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            max_steps=STEPS,
            per_device_train_batch_size=ROWS,
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            lr_scheduler_type="constant",
            train_sampling_strategy="sequential",
            activation_checkpointing=True,
            max_grad_norm=0.01,
            gradient_accumulation_steps=accumulation,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        params = {"vote": VoteConfig(tie="exact"), "momentum": BETAS[kind]}
        spec = {"type": kind, "params": params}
        SignTrainer(model=model, args=args, train_dataset=_Tokens(), sign_optimizer=spec).train()
    return [p.detach().clone() for p in model.parameters()]


def reference(world_size: int, kind: str, accumulation: int) -> list[torch.Tensor]:
    """The definition: each worker's momentum of its gradient (of its ``accumulation`` micro-batches'
    mean loss; SignMuon: Newton–Schulz of the Nesterov look-ahead on the matrices but the embeddings),
    the vote of their signs, decoupled weight decay on the matrices (the Trainer's: none on biases
    and norms)."""
    from signmuon.optim.newton_schulz import as_matrix, newton_schulz

    torch.set_num_threads(1)
    model = _gpt2()
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    beta = BETAS[kind]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    for step in range(STEPS):
        signs = [torch.zeros_like(p) for p in params]
        for worker in range(world_size):
            net = _gpt2()
            with torch.no_grad():
                for p, v in zip(net.parameters(), params):
                    p.copy_(v)
            for micro in range(accumulation):
                ids = _batch(world_size, worker, step * accumulation + micro)
                (net(input_ids=ids, labels=ids).loss / accumulation).backward()
            for i, p in enumerate(net.parameters()):
                if p.grad is None:
                    continue
                momentum = momenta[worker][i].lerp_(p.grad, 1 - beta)
                direction = momentum
                if kind == "SignMuon":
                    direction = p.grad.lerp(momentum, beta)
                    if p.dim() >= 2 and not names[i].startswith(("transformer.wte", "transformer.wpe")):
                        direction = newton_schulz(as_matrix(direction), 5).view_as(direction)
                signs[i] += torch.sign(direction)
        params = [
            p * (1 - LR * WEIGHT_DECAY) - LR * torch.sign(s) if p.dim() >= 2 else p.add(torch.sign(s), alpha=-LR)
            for p, s in zip(params, signs)
        ]
    return params


def checkpointing_cells() -> list[Cell]:
    """SignumMV at accumulation 1; SignMuon at 2 (no_sync under the Trainer, with recomputation)."""
    cells = []
    for kind, accumulation in (("SignumMV", 1), ("SignMuon", 2)):
        more = ", gradient_accumulation_steps=2" if accumulation > 1 else ""
        cells.append(
            Cell(
                "HF Trainer",
                "what runs after the hook",
                f"{kind}, activation_checkpointing=True, max_grad_norm=0.01, weight_decay=0.1{more}: the definition",
                partial(trainer_fit, kind=kind, accumulation=accumulation),
                partial(reference, kind=kind, accumulation=accumulation),
                atol=1e-6 if kind == "SignMuon" else 0.0,
            )
        )
    return cells
