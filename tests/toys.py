"""The tiny model, batches and error capture the multi-process tests share (not shipped)."""

import torch
from torch import nn


def tiny_net() -> nn.Module:
    """6 -> 12 -> 3 MLP, the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent inputs and labels for ``tiny_net``."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


def capture(fn) -> str | None:
    """None if ``fn()`` returns, else ``"ErrorType: message"`` (what the tests compare across ranks)."""
    try:
        fn()
        return None
    except Exception as error:  # noqa: BLE001 - the tests inspect type and message
        return f"{type(error).__name__}: {error}"
