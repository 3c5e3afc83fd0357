"""torch's DistributedDataParallel behind the common interface: the industry reference.

DDP buckets gradients (``sync.bucket_mb``), all-reduces each bucket during backward as soon as it
is ready, and skips communication inside ``no_sync()``, which wraps the non-boundary micro-steps
of an accumulation window. Its communication therefore happens inside ``t_backward``; ``t_sync``
is only the end of the step, and ``t_wait`` is 0 (DDP does not expose what it waited for).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from testbed.checks import require
from testbed.models import gradient_bytes
from testbed.sync.allreduce import NATIVE
from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SimModel, SyncBase, SyncSpec
from testbed.world import World


@dataclass
class DdpSyncConfig(SyncBase):
    name: str = "ddp"
    bucket_mb: float = 25.0  # DistributedDataParallel's bucket_cap_mb


class DdpSync(Synchronizer):
    waits_for_peers = False

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.module = DistributedDataParallel(
            model,
            device_ids=[world.device.index] if world.device.type == "cuda" else None,
            bucket_cap_mb=float(self.cfg.bucket_mb),
            gradient_as_bucket_view=True,  # no copy between the buckets and p.grad
            broadcast_buffers=False,
        )
        n = world.world_size
        self.bytes_per_step = 2 * (n - 1) * gradient_bytes(model) // n  # what its ring all-reduce moves

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        # DDP decides during forward whether backward communicates.
        return nullcontext() if is_boundary else self.module.no_sync()

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        return SyncReport(bytes_sent=self.bytes_per_step, bytes_recv=self.bytes_per_step)

    def zero_grad(self) -> None:
        # Zero in place: the grads are views into DDP's buckets.
        self.optimizer.zero_grad(set_to_none=False)

    def describe(self) -> dict[str, Any]:
        return {"bucket_mb": float(self.cfg.bucket_mb), "backend": self.world.backend}

    def close(self) -> None:
        # Drop DDP while the process group is still registered. Its reducer holds the group; were
        # the reducer's reference the last, the group would be destroyed inside the reducer's
        # destructor, which joins Gloo's worker threads holding the GIL while one of them may need
        # it to free a finished collective's tensor: a rank hung at exit that way.
        self.module = self.model


SPEC = SyncSpec(
    name="ddp", schema=DdpSyncConfig, impl=DdpSync,
    sim=SimModel(series=NATIVE.series, cost=NATIVE.cost, overlap=lambda cfg: True),  # DDP always overlaps
    check=lambda cfg: require(cfg.sync.bucket_mb > 0, f"sync.bucket_mb={cfg.sync.bucket_mb}: must be > 0 (DDP's bucket cap)"),
)
