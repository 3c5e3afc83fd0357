"""Optimizers by name, from the ``optim`` config group."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from testbed.checks import require


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


def check_optimizer(optim: Any) -> None:
    """Refuse, before anything starts, the settings torch's optimizer would refuse on every rank
    (or, for a rate of 0, accept and never train)."""
    require(optim.lr > 0, f"optim.lr={optim.lr}: the learning rate must be > 0 (e.g. optim.lr=0.05)")
    require(optim.weight_decay >= 0, f"optim.weight_decay={optim.weight_decay}: must be >= 0 (0: none)")
    if optim.name == "sgd":
        require(optim.momentum >= 0, f"optim.momentum={optim.momentum}: must be >= 0 (0: plain SGD)")
        require(not optim.nesterov or optim.momentum > 0,
                "optim.nesterov=true needs momentum: set optim.momentum > 0 or optim.nesterov=false")
    elif optim.name == "adamw":
        betas = list(optim.betas)
        require(len(betas) == 2 and all(0 <= b < 1 for b in betas),
                f"optim.betas={betas}: two decay rates, each in [0, 1) (e.g. optim.betas=[0.9,0.999])")
        require(optim.eps >= 0, f"optim.eps={optim.eps}: must be >= 0 (e.g. optim.eps=1e-8)")


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


def settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s settings, as its constructor takes them."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def like(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s kind and settings over ``params`` (a rank's shard)."""
    return type(optimizer)(params, **settings(optimizer))


def follow(leader: torch.optim.Optimizer, follower: torch.optim.Optimizer) -> None:
    """Give ``follower``'s groups the settings of ``leader``'s (the trainer's, whose learning rate
    the schedule sets each step) before ``follower`` steps."""
    current = {key: value for key, value in leader.param_groups[0].items() if key != "params"}
    for group in follower.param_groups:
        group.update(current)
