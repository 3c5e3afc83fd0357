"""A model outside the testbed, for model=custom (tests/test_pipeline.py puts this folder on PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayer(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int = 10) -> None:
        super().__init__()
        self.first = nn.Linear(in_features, hidden)
        self.second = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x.flatten(1))))
