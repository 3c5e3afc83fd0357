"""Optimizers by name, from the ``optim`` config group."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LrScheduleConfig:
    """The learning-rate schedule every synchronizer follows (testbed.eval.schedule)."""

    lr_scaling: str = "none"  # none | linear | sqrt: optim.lr times (global batch / base_batch), or its root
    base_batch: int | None = None  # the global batch optim.lr is tuned for; null: data.batch_size
    warmup_steps: int = 0  # gradual warmup to the (scaled) rate over this many steps ...
    warmup_epochs: float = 0.0  # ... or epochs of the training data (Goyal et al.: 5)
    schedule: str = "constant"  # constant | cosine | step (after warmup)
    min_lr: float = 0.0  # cosine: the rate at the last step
    milestones: list[int] = field(default_factory=list)  # step: the steps at which the rate is multiplied by gamma
    gamma: float = 0.1


@dataclass
class SgdConfig(LrScheduleConfig):
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamWConfig(LrScheduleConfig):
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


SCHEMAS = {"sgd": SgdConfig, "adamw": AdamWConfig}


def build_optimizer(cfg: Any, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ValueError(f"optim={cfg.name}: unknown; allowed: {'|'.join(SCHEMAS)}")
