"""Our per-rank optimizer files in a DeepSpeed checkpoint's tag folder, and how they are read."""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["RANK_STATE_FILE", "read_rank_file"]

RANK_STATE_FILE = "signmuon_optimizer_rank{rank:05d}.pt"
"""Each rank's optimizer state (its momentum), beside DeepSpeed's files in the tag's folder."""


def read_rank_file(path: str) -> dict[str, Any]:
    """A rank's optimizer state as :func:`_checkpoint_per_rank` wrote it: tensors, numbers and
    strings, read with ``weights_only=True``. A file holding any other pickled object is refused
    (pickle.UnpicklingError naming it): unpickling it would run its code on every rank."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(
            f"{path} holds more than tensors, numbers and strings ({_blocked(error)}), which signmuon's per-rank "
            "optimizer files never do: refusing to unpickle it, as that could run code. Was the checkpoint "
            "directory changed after save_checkpoint wrote it?"
        ) from error


def _blocked(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused: its line naming the global, else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "not plain data")
