"""No communication: each replica follows its own shard and the replicas drift apart.

It measures the headroom: the throughput every other synchronizer would reach if communication
were free. Its final model is not a data-parallel model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SyncBase, SyncSpec


@dataclass
class NoneSyncConfig(SyncBase):
    name: str = "none"


class NoSync(Synchronizer):
    waits_for_peers = False

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        return SyncReport(replicas_agree=self.world.world_size == 1)

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """The replicas differ and none is the run's model: rank 0's is evaluated, by every rank."""
        if self.world.world_size == 1:
            yield self.model, {"model": "replicas"}
            return
        params = [p.detach() for p in self.model.parameters()]
        own = [p.clone() for p in params]
        for p in params:
            dist.broadcast(p, src=0)
        try:
            yield self.model, {"model": "rank 0's replica (not synchronized)"}
        finally:
            with torch.no_grad():
                for p, mine in zip(params, own):
                    p.copy_(mine)


SPEC = SyncSpec(name="none", schema=NoneSyncConfig, impl=NoSync, sim=None, no_codec="nothing is communicated",
                averaged_gradient=lambda cfg: "nothing is averaged",
                unbalanced=lambda cfg: "nothing is averaged, so no step waits for a slow rank",
                inelastic="nothing is synchronized, so no worker waits for a lost one: there is no membership")
