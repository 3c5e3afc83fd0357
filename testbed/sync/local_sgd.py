"""Local SGD: each worker steps its own optimizer; the parameters are averaged every H steps.

With ``sync_steps = K > 0`` it is post-local SGD (Lin et al. 2020): gradients are all-reduced
(fully synchronous training) for the first K steps, then local steps begin. With H = 1 and SGD
(momentum included, a linear update) it trains exactly the synchronous model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.collectives import ring_allreduce_
from testbed.sync import register
from testbed.sync.base import Synchronizer, SyncReport, flat_views
from testbed.world import World


@register("local_sgd")
class LocalSgd(Synchronizer):
    steps_optimizer = True  # it steps the worker's own optimizer, then maybe averages

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.flat_params, self.flat_grads = flat_views(model, world.device)
        self.scratch = torch.empty(-(-self.flat_params.numel() // world.world_size), dtype=self.flat_params.dtype)
        n = world.world_size
        self.bytes_per_average = 2 * (n - 1) * self.flat_params.numel() * self.flat_params.element_size() // n

    def _average_(self, flat: torch.Tensor) -> None:
        n = self.world.world_size
        if n == 1:
            return
        if self.cfg.over == "ring":
            ring_allreduce_(flat, scratch=self.scratch)
        else:
            dist.all_reduce(flat)
        flat.div_(n)

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        moved = self.bytes_per_average if self.world.world_size > 1 else 0
        if step < self.cfg.sync_steps:  # post-local warm-up: synchronous SGD
            self._average_(self.flat_grads)
            self.optimizer.step()
            return SyncReport(bytes_sent=moved, bytes_recv=moved)
        self.optimizer.step()
        if (step - self.cfg.sync_steps + 1) % self.cfg.period:
            return SyncReport(t_wait=0.0, replicas_agree=False)  # a local step: nobody to wait for
        self._average_(self.flat_params)
        return SyncReport(bytes_sent=moved, bytes_recv=moved)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def describe(self) -> dict[str, Any]:
        return {"period": int(self.cfg.period), "sync_steps": int(self.cfg.sync_steps), "over": self.cfg.over}
