"""Facts about the parameters an optimizer is given, shared by the optimizers and the rounds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor", "refuse_sparse", "refuse_sparse_gradients", "state_dtype"]


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's optimizer state: float32 for 16-bit parameters (momentum
    and Newton–Schulz keep their precision), else the parameter's own."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its storage, so in-place updates land), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def refuse_sparse(param: torch.Tensor, label: str, optimizer: str) -> None:
    """A sparse parameter fails here, by name, not deep in a kernel."""
    if param.layout != torch.strided:
        raise ValueError(f"{label} is a {param.layout} tensor; {optimizer} needs dense parameters")


def refuse_sparse_gradients(params: list[torch.Tensor], optimizer: str) -> None:
    for p in params:
        if p.grad is not None and p.grad.layout != torch.strided:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has a {p.grad.layout} gradient; {optimizer} "
                "needs dense gradients (e.g. nn.Embedding(..., sparse=False))"
            )
