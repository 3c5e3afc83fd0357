"""Balanced batches: each rank's share of the global batch proportional to its measured speed.

A synchronous step waits for its slowest rank. LB-BSP (Chen et al. 2018, "Fast Distributed Deep
Learning via Worker-adaptive Batch Sizing") gives faster workers bigger batches, keeping the global
batch, so that every rank finishes its compute at once. Here each rank measures its samples per
second of compute over a window of ``every`` steps (data, injected slowness, forward, backward:
the work that grows with the batch, not the optimizer's), one all-reduce shares the speeds, and
every rank splits the global batch in proportion (testbed.imbalance.apportion): the same sizes
everywhere, from the next step on. ``static`` decides once, after the first window; ``dynamic``
after every window, following speeds that drift.

The global batch's samples stay the same and in the same order (testbed.data.batches.RankBatches:
rank r takes the sizes[r] positions after ranks 0..r-1), and each rank's loss is weighted by
n·b_r/B (testbed.imbalance.loss_weight), so the averaged gradient is still the global batch's mean:
the model is the one a single process trains on the concatenated batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from testbed.checks import Option, options, require
from testbed.data import data_kind
from testbed.imbalance import apportion
from testbed.step_record import StepRecord
from testbed.sync import SYNCHRONIZERS


@dataclass
class BalanceConfig:
    """The fields of every option, so that a sweep over balance=none,dynamic may set balance.every."""

    name: str = "none"
    # static: the steps measured before the batches are set, once; dynamic: the steps between
    # decisions, each on the speeds measured since the last.
    every: int = 10


@dataclass
class StaticBalanceConfig(BalanceConfig):
    name: str = "static"


@dataclass
class DynamicBalanceConfig(BalanceConfig):
    name: str = "dynamic"


def _check(cfg: Any) -> None:
    balance = cfg.balance
    require(balance.every >= 1, f"balance.every={balance.every}: steps between decisions, must be >= 1")
    why = SYNCHRONIZERS[cfg.sync.name].unbalanced(cfg)
    require(why is None, f"balance={balance.name} with sync={cfg.sync.name}: {why}")
    require(data_kind(cfg.data.name).resizable,
            f"balance={balance.name} with data={cfg.data.name}: its batches have a fixed size (a DataLoader's, or one "
            "random batch); use an in-memory data set (synthetic|digits|mnist1d|lm)")
    require(cfg.imbalance.name != "uneven", f"balance={balance.name} with imbalance=uneven: uneven fixes each rank's "
                                            "share of the batch, balance decides it; use one of them")
    require(not (cfg.checkpoint.every or cfg.resume),
            f"balance={balance.name} with checkpoint.every/resume: checkpoints do not hold the batches decided so far, "
            "so a resumed run would train on other batches than an uninterrupted one; drop one of them")


BALANCES = options(
    Option("none", BalanceConfig),
    Option("static", StaticBalanceConfig, _check),
    Option("dynamic", DynamicBalanceConfig, _check),
)


class SpeedWindow:
    """Samples per second of the work that grows with the batch (data, injected slowness, forward,
    backward), summed over windows of ``every`` steps after ``first`` (whose compute has no injected
    slowness yet: not measured); ``once`` (static) closes one window only. The rule the trainer's
    Balancer and the simulator (testbed.sim.step) both decide by: one rank's floats, or every
    rank's numpy arrays."""

    def __init__(self, every: int, once: bool, first: int) -> None:
        self.every, self.once, self.first = every, once, first
        self.samples: Any = 0
        self.seconds: Any = 0.0
        self.decided = False

    def add(self, step: int, samples: Any, seconds: Any) -> bool:
        """Counts this step's work; True when it ends a window in which every rank was measured."""
        if self.once and self.decided:
            return False
        if step > self.first:
            self.samples = self.samples + samples
            self.seconds = self.seconds + seconds
        return not (step + 1 - self.first) % self.every and bool(np.all(self.seconds))

    def take(self) -> Any:
        """The window's speeds, and a new window."""
        speeds = self.samples / self.seconds
        self.samples, self.seconds, self.decided = 0, 0.0, True
        return speeds


class Balancer:
    """Decides the ranks' batches from their measured speeds; ``resize`` applies new sizes to this
    rank's batch stream."""

    def __init__(self, cfg: Any, sizes: list[int], rank: int, device: torch.device, start_step: int,
                 resize: Callable[[list[int]], None]) -> None:
        self.window = SpeedWindow(int(cfg.every), cfg.name == "static", start_step)
        self.sizes, self.rank, self.device, self.resize = list(sizes), rank, device, resize

    def after_step(self, step: int, record: StepRecord) -> list[int] | None:
        """The new sizes when this step ends a window and they change, else None."""
        seconds = record.t_data + record.t_injected + record.t_forward + record.t_backward
        if not self.window.add(step, record.samples, seconds):
            return None
        speeds = torch.zeros(len(self.sizes), dtype=torch.float64, device=self.device)
        speeds[self.rank] = self.window.take()
        dist.all_reduce(speeds)  # every rank decides from the same speeds: the same sizes

        sizes = apportion(sum(self.sizes), speeds.cpu().tolist())
        if sizes == self.sizes:
            return None
        self.sizes = sizes
        self.resize(sizes)
        return sizes
