"""VGG-16 (configuration "D", no batch norm), mirroring torchvision.models.vgg16.

Defined here because torchvision's PyPI wheels do not import beside the project's CPU torch build.
At the defaults the module equals torchvision's: attributes ``features``, ``avgpool``, ``classifier``,
the same ``state_dict()`` keys, shapes and order, the same initialisation and forward.
"""

from __future__ import annotations

import torch
from torch import nn

_CFG_D: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, features: nn.Sequential, channels: int, num_classes: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(
    num_classes: int = 1000, in_channels: int = 3, width: int = 64, hidden: int = 4096, dropout: float = 0.5
) -> nn.Module:
    """torchvision's ``vgg16``; ``width`` scales the conv channels (64..512 times width/64), ``hidden`` the classifier."""
    if width < 1 or hidden < 1:
        raise ValueError(f"vgg16 width={width} hidden={hidden}: both must be >= 1")
    layers: list[nn.Module] = []
    cin = in_channels
    for v in _CFG_D:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            cout = int(v) * width // 64  # exact: every entry is a multiple of 64
            layers += [nn.Conv2d(cin, cout, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            cin = cout
    return VGG(nn.Sequential(*layers), cin, num_classes, hidden, dropout)
