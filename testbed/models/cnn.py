from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _norm(channels: int) -> nn.GroupNorm:
    # GroupNorm, not BatchNorm: BatchNorm's statistics are per-rank, so data-parallel training
    # would no longer equal single-process training on the concatenated batch.
    return nn.GroupNorm(min(8, channels), channels)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR-style ResNet: stages of basic blocks, width doubling and stride 2 per stage."""

    def __init__(self, in_channels: int, num_classes: int, width: int, blocks: list[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), _norm(width), nn.ReLU())
        stages: list[nn.Module] = []
        cin = width
        for i, count in enumerate(blocks):
            cout = width * 2**i
            for j in range(count):
                stages.append(BasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
