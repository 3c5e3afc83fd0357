"""Optimizers by name, from the ``optim`` config group."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def build_optimizer(cfg: Any, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ValueError(f"optim={cfg.name}: unknown; allowed: sgd|adamw")
