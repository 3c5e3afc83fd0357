from __future__ import annotations

import torch
from torch import nn


class Mlp(nn.Module):
    """Flatten, then ``depth`` hidden layers of width ``hidden`` with ReLU, then a linear head."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
