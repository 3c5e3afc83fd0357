"""Models outside the testbed, for model=custom (the tests put this folder on PYTHONPATH)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # imported where used: transformers takes seconds to import
    from transformers.modeling_outputs import SequenceClassifierOutput


class TwoLayer(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int = 10) -> None:
        super().__init__()
        self.first = nn.Linear(in_features, hidden)
        self.second = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x.flatten(1))))


class LazyTwoLayer(nn.Module):
    """TwoLayer that learns its input size from the first batch (torch.nn.LazyLinear)."""

    def __init__(self, hidden: int, num_classes: int = 10) -> None:
        super().__init__()
        self.first = nn.LazyLinear(hidden)
        self.second = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x.flatten(1))))


@dataclass
class GPTConfig:
    """nanoGPT's model config (model.py), cut down."""

    block_size: int = 16
    vocab_size: int = 64
    n_embd: int = 16


class GPT(nn.Module):
    """nanoGPT's calling convention: forward(idx, targets) returns (logits, loss); without targets,
    the logits of the last position only and no loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.mix = nn.Linear(config.n_embd, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x + torch.tanh(self.mix(x)).cumsum(1) / torch.arange(1, idx.shape[1] + 1, device=idx.device)[:, None]
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class LabelledClassifier(nn.Module):
    """Hugging Face's calling convention: forward(x, labels=None) returns a ModelOutput with
    ``.logits``, and ``.loss`` when given the labels."""

    def __init__(self, in_features: int, num_classes: int = 10) -> None:
        super().__init__()
        self.classifier = nn.Linear(in_features, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(pixel_values.flatten(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Tempered(TwoLayer):
    """TwoLayer with a learned temperature: a scalar parameter, which FSDP2 cannot shard."""

    def __init__(self, in_features: int, hidden: int, num_classes: int = 10) -> None:
        super().__init__(in_features, hidden, num_classes)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature
