"""Which parameters take the Newton–Schulz path: the routing Muon users expect, built from a model.

Muon orthogonalises the hidden layers' matrices only. An embedding's rows are looked up one at a
time (orthogonalising the whole table mixes tokens that never met in the batch), and the output
head maps to logits whose scale the loss cares about; both go on the optimizer's other path, with
biases and norm gains. By shape alone both would be matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["HEAD_NAMES", "muon_param_groups"]

# Attribute names output heads go by in common models (nanoGPT, HF transformers, timm, Llama).
# Not "fc": hidden layers are called that too (pass head_names=("fc",) for torchvision's ResNet).
HEAD_NAMES = ("lm_head", "head", "output", "classifier", "fc_out", "score")


def muon_param_groups(
    model: nn.Module, *, head_names: Iterable[str] = HEAD_NAMES, **matrix_options: Any
) -> list[dict[str, Any]]:
    """Param groups for :class:`~signmuon.optim.SignMuon` (or any optimizer reading ``use_muon``).

    Returns ``[{"params", "param_names", "use_muon": True, **matrix_options}, {"params",
    "param_names", "use_muon": False}]`` (an empty group left out): 2-D and larger parameters on the
    matrix path, except the weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules and of the
    modules whose attribute name is in ``head_names`` (a head *last* in the module, e.g.
    ``lm_head`` or ``classifier``; for torchvision's ResNet pass ``head_names=("fc",)``); those and every 1-D
    parameter on the other path. Trainable parameters only, each tensor once: a head tied to the
    embedding (nanoGPT, GPT-2) is one parameter and lands on the non-matrix path.

    Args:
        model: the module to route (not yet wrapped in DDP, or its ``.module``).
        head_names: attribute names that mark an output head.
        **matrix_options: extra settings for the matrix group (e.g. ``lr``).
    """
    heads = set(head_names)
    off_matrix: set[int] = set()
    for name, module in model.named_modules():
        is_head = name.rsplit(".", 1)[-1] in heads and isinstance(module, nn.Linear)
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or is_head:
            off_matrix.update(id(p) for p in module.parameters(recurse=False))
    matrix: dict[str, Any] = {"params": [], "param_names": [], "use_muon": True, **matrix_options}
    other: dict[str, Any] = {"params": [], "param_names": [], "use_muon": False}
    for name, param in model.named_parameters():  # each tensor once, under its first name
        if not param.requires_grad:
            continue
        group = matrix if param.dim() >= 2 and id(param) not in off_matrix else other
        group["params"].append(param)
        group["param_names"].append(name)
    return [group for group in (matrix, other) if group["params"]]
