"""Models by name. Each is built from its config group node and the data's input spec."""

from __future__ import annotations

from typing import Any

from torch import nn

from testbed.data import DataSpec
from testbed.models.cnn import ResNet
from testbed.models.mlp import Mlp
from testbed.models.transformer import Gpt


def build_model(cfg: Any, spec: DataSpec) -> nn.Module:
    if cfg.name == "mlp":
        return Mlp(spec.input_numel, spec.num_classes, cfg.hidden, cfg.depth)
    if cfg.name == "cnn":
        return ResNet(spec.shape[0], spec.num_classes, cfg.width, list(cfg.blocks))
    if cfg.name == "transformer":
        return Gpt(spec.vocab_size, spec.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head)
    raise ValueError(f"model={cfg.name}: unknown; allowed: mlp|cnn|transformer")


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
