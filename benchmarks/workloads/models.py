"""Models the step benchmarks time: an MLP whose size is its width and depth."""

from __future__ import annotations

from torch import nn

__all__ = ["mlp"]


def mlp(width: int, depth: int, inputs: int = 512, classes: int = 10) -> nn.Module:
    """``depth`` ReLU layers of ``width`` on ``inputs`` features, then ``classes`` outputs."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)
