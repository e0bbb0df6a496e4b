"""Training tasks for the benchmarks: data that ships with an installed package, or a user's path.

* ``digits``: scikit-learn's 8x8 digits, a small CNN, a fixed 80/20 split.
* ``charlm``: a small GPT on the bytes of the Python standard library's own source files,
  train/validation split by file (every 10th file is validation).
* ``cifar10``: CIFAR-10 in torchvision's on-disk format (``cifar-10-batches-py``) under
  ``--data-dir``, ResNet-18 or ResNet-50; read with pickle, so torchvision is not needed.

A task hands out examples by index, so every rank draws the same global batch of indices and
takes its own slice.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import pickle
import sysconfig
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["CHARLM_SIZES", "Task", "TASKS", "make_task", "TinyGPT", "resnet18", "resnet50"]


@dataclasses.dataclass(kw_only=True)
class Task:
    """A dataset, a model and how to score it."""

    name: str
    make_model: Callable[[], nn.Module]
    """A freshly initialised model (call after seeding)."""
    num_examples: int
    """Training examples (indices 0..num_examples-1)."""
    batch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """Training (inputs, targets) for a tensor of example indices."""
    held_out: list[tuple[torch.Tensor, torch.Tensor]]
    """Validation/test batches, fixed."""
    language_model: bool = False
    """Report perplexity besides (next-token) accuracy."""


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers ([B, C] vs [B]) and language models ([B, T, V] vs [B, T])."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, task: Task) -> dict[str, float]:
    """Mean loss and accuracy (and perplexity for language models) on the held-out batches."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    device = next(model.parameters()).device
    for x, y in task.held_out:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total_loss += float(loss_fn(logits, y)) * y.numel()
        correct += int((logits.argmax(dim=-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    scores = {"test_loss": total_loss / count, "test_acc": correct / count}
    if task.language_model:
        scores["test_ppl"] = math.exp(scores["test_loss"])
    return scores


# --- digits -------------------------------------------------------------------------------


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train [N,1,8,8], y_train, x_test, y_test) from scikit-learn's digits, scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("the digits task needs scikit-learn: pip install 'signmuon[bench]'") from error
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def digits_task(seed: int = 0, data_dir: str | None = None) -> Task:
    x_train, y_train, x_test, y_test = digits_data(seed)
    return Task(
        name="digits",
        make_model=digits_cnn,
        num_examples=len(y_train),
        batch=lambda idx: (x_train[idx], y_train[idx]),
        held_out=[(x_test, y_test)],
    )


# --- charlm -------------------------------------------------------------------------------


class TinyGPT(nn.Module):
    """A small causal transformer over bytes: [B, T] byte ids -> [B, T, 256] logits."""

    def __init__(self, context: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        h = self.embed(idx) + self.position[:length]  # [B, T, dim]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=idx.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def stdlib_text(max_bytes: int = 2_000_000) -> tuple[bytes, bytes]:
    """(train, validation) bytes of the standard library's top-level ``.py`` files, split by file."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train, val, total = [], [], 0
    for i, path in enumerate(sorted(root.glob("*.py"))):
        data = path.read_bytes()
        (val if i % 10 == 9 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not val:
        raise RuntimeError(f"found too little Python source under {root} for the charlm task")
    return b"".join(train), b"".join(val)


# GPT shapes by name: "small" trains in seconds on a laptop; "medium" (about 14M parameters) is
# large enough that gradient communication matters on a 1-10 Gbit/s network.
CHARLM_SIZES: dict[str, dict[str, int]] = {
    "small": {"context": 64, "dim": 64, "layers": 2, "heads": 4},
    "medium": {"context": 128, "dim": 384, "layers": 8, "heads": 6},
}


def charlm_task(seed: int = 0, data_dir: str | None = None, size: str = "small") -> Task:
    if size not in CHARLM_SIZES:
        raise ValueError(f"size={size!r}: choose from {sorted(CHARLM_SIZES)}")
    shape = CHARLM_SIZES[size]
    context = shape["context"]
    train_bytes, val_bytes = stdlib_text()
    train = torch.from_numpy(np.frombuffer(train_bytes, dtype=np.uint8).astype(np.int64))
    val = torch.from_numpy(np.frombuffer(val_bytes, dtype=np.uint8).astype(np.int64))

    def windows(text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = starts.unsqueeze(1) + torch.arange(context + 1)  # [B, T+1]
        chunk = text[offsets]
        return chunk[:, :-1], chunk[:, 1:]

    gen = torch.Generator().manual_seed(seed)
    val_starts = torch.randint(0, len(val) - context - 1, (512,), generator=gen)
    return Task(
        name="charlm",
        make_model=lambda: TinyGPT(**shape),
        num_examples=len(train) - context - 1,
        batch=lambda idx: windows(train, idx),
        held_out=[windows(val, s) for s in val_starts.split(128)],
        language_model=True,
    )


# --- cifar10 ------------------------------------------------------------------------------


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity, or a 1x1 projection where the block changes shape."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu(self.body(x) + self.skip(x))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu(self.body(x) + self.skip(x))


def _resnet(blocks: tuple[int, ...], bottleneck: bool, classes: int) -> nn.Module:
    """ResNet for 32x32 inputs (3x3 stem, no max-pool), as usual for CIFAR."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for width, stride, count in zip((64, 128, 256, 512), (1, 2, 2, 2), blocks):
        for i in range(count):
            block = (
                _Bottleneck(cin, width, stride if i == 0 else 1)
                if bottleneck
                else _BasicBlock(cin, width, stride if i == 0 else 1)
            )
            layers.append(block)
            cin = 4 * width if bottleneck else width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def resnet18(classes: int = 10) -> nn.Module:
    return _resnet((2, 2, 2, 2), bottleneck=False, classes=classes)


def resnet50(classes: int = 10) -> nn.Module:
    return _resnet((3, 4, 6, 3), bottleneck=True, classes=classes)


def load_cifar10(data_dir: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train [50000,3,32,32] float in [0,1], y_train, x_test, y_test) from torchvision's format."""
    root = pathlib.Path(data_dir) / "cifar-10-batches-py"
    if not root.is_dir():
        raise FileNotFoundError(
            f"cifar10 needs torchvision's CIFAR-10 folder at {root} (data_batch_1..5, test_batch); "
            "pass its parent with --data-dir"
        )

    def read(names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for name in names:
            with open(root / name, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            xs.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch["labels"], dtype=np.int64))
        return torch.from_numpy(np.concatenate(xs)).float() / 255.0, torch.from_numpy(np.concatenate(ys))

    x_train, y_train = read([f"data_batch_{i}" for i in range(1, 6)])
    x_test, y_test = read(["test_batch"])
    return x_train, y_train, x_test, y_test


def cifar10_task(seed: int = 0, data_dir: str | None = None, arch: str = "resnet18") -> Task:
    if data_dir is None:
        raise ValueError("the cifar10 task reads CIFAR-10 from disk: pass --data-dir")
    x_train, y_train, x_test, y_test = load_cifar10(data_dir)
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return Task(
        name="cifar10",
        make_model={"resnet18": resnet18, "resnet50": resnet50}[arch],
        num_examples=len(y_train),
        batch=lambda idx: (x_train[idx], y_train[idx]),
        held_out=list(zip(x_test.split(500), y_test.split(500))),
    )


TASKS: dict[str, Callable[..., Task]] = {"digits": digits_task, "charlm": charlm_task, "cifar10": cifar10_task}


def make_task(
    name: str, seed: int = 0, data_dir: str | None = None, arch: str = "resnet18", size: str = "small"
) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    if name == "charlm":
        return charlm_task(seed=seed, data_dir=data_dir, size=size)
    if size != "small":
        raise ValueError(f"size={size!r} is charlm's option; {name} has one model size")
    if arch not in ("resnet18", "resnet50"):
        raise ValueError(f"arch={arch!r} must be resnet18 or resnet50")
    if name == "cifar10":
        return cifar10_task(seed=seed, data_dir=data_dir, arch=arch)
    return TASKS[name](seed=seed, data_dir=data_dir)
