"""Explicit ring all-reduce over point-to-point send/recv (testbed.collectives.ring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.collectives.common import chunk_bounds
from testbed.collectives.ring import ring_allreduce_
from testbed.costs import ring
from testbed.sync.flat import FlatGradSynchronizer
from testbed.sync.spec import BucketedSyncConfig, SimModel, SyncSpec, node_ordered_ring, require_gloo_cpu


@dataclass
class RingSyncConfig(BucketedSyncConfig):
    name: str = "ring"


class RingAllReduce(FlatGradSynchronizer):
    def make_scratch(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = chunk_bounds(flat.numel(), self.world.world_size)[0]
        return torch.empty(max(1, hi - lo), dtype=flat.dtype, device=flat.device)

    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        traffic = ring_allreduce_(flat, scratch=scratch)
        return traffic.sent, traffic.recv


RING = SimModel(series=lambda cfg: "ring", cost=lambda cfg: lambda s: ring(int(cfg.world_size), s),
                two_level=node_ordered_ring)

SPEC = SyncSpec(name="ring", schema=RingSyncConfig, impl=RingAllReduce, sim=RING, compresses=True,
                check=lambda cfg: require_gloo_cpu(cfg, "sync=ring"),
                inelastic=None)
