"""Local SGD: each worker steps its own optimizer; the parameters are averaged every H steps.

With ``sync_steps = K > 0`` it is post-local SGD (Lin et al. 2020): gradients are all-reduced
(fully synchronous training) for the first K steps, then local steps begin. With H = 1 and SGD
(momentum included, a linear update) it trains exactly the synchronous model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.checks import require
from testbed.collectives.ring import ring_allreduce_
from testbed.sync.allreduce import NATIVE
from testbed.sync.base import Synchronizer, SyncReport, flat_views, holding
from testbed.sync.ring import RING
from testbed.sync.spec import SimModel, SyncBase, SyncSpec, require_gloo_cpu
from testbed.world import World

AVERAGE_OVER = ("allreduce", "ring")


@dataclass
class LocalSgdSyncConfig(SyncBase):
    name: str = "local_sgd"
    period: int = 8  # H: parameters are averaged every H optimizer steps
    sync_steps: int = 0  # post-local SGD: fully synchronous (gradient all-reduce) for the first K steps
    over: str = "allreduce"  # the averaging collective: allreduce (the backend's) | ring


def averages_at(sync: Any, step: int) -> bool:
    """Whether ranks communicate (and meet) at ``step`` under the sync config ``sync``: every
    warm-up step (gradients), then every period's last (parameters)."""
    return step < int(sync.sync_steps) or (step - int(sync.sync_steps) + 1) % int(sync.period) == 0


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
        if not averages_at(self.cfg, step):
            return SyncReport(t_wait=0.0, replicas_agree=False)  # a local step: nobody to wait for
        self._average_(self.flat_params)
        return SyncReport(bytes_sent=moved, bytes_recv=moved)

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """Between averaging steps the replicas differ; the run's model is their average."""
        average = self.flat_params.clone()
        self._average_(average)
        with holding(self.flat_params, average):
            yield self.model, {"model": "replica average"}

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def describe(self) -> dict[str, Any]:
        return {"period": int(self.cfg.period), "sync_steps": int(self.cfg.sync_steps), "over": self.cfg.over}


def _check(cfg: Any) -> None:
    sync = cfg.sync
    require(sync.period >= 1, f"sync.period={sync.period}: must be >= 1")
    require(sync.sync_steps >= 0, f"sync.sync_steps={sync.sync_steps}: must be >= 0")
    require(sync.over in AVERAGE_OVER, f"sync.over={sync.over}: allowed: {'|'.join(AVERAGE_OVER)}")
    if sync.over == "ring":
        require_gloo_cpu(cfg, "sync=local_sgd sync.over=ring")


def _over(cfg: Any) -> SimModel:
    return RING if cfg.sync.over == "ring" else NATIVE


SPEC = SyncSpec(
    name="local_sgd", schema=LocalSgdSyncConfig, impl=LocalSgd, check=_check,
    sim=SimModel(series=lambda cfg: _over(cfg).series(cfg), cost=lambda cfg: _over(cfg).cost(cfg), schedule="average",
                 meets=lambda cfg, step: averages_at(cfg.sync, step)),
    no_codec="it averages parameters, not gradients, and encoding the model delta is not built",
    averaged_gradient=lambda cfg: "local SGD averages parameters every few steps, never a step's gradients",
    unbalanced=lambda cfg: "a rank's local steps are its own batches', not one global batch's; balance the batches of a "
                           "synchronous synchronizer",
    inelastic="its averaging writes into the parameters, which an abandoned collective could still write after the rollback",
)
