"""Recursive halving-doubling all-reduce (Rabenseifner) over point-to-point send/recv.

Reduce-scatter by recursive halving, then all-gather by recursive doubling: 2 log2 n messages
instead of the ring's 2(n - 1), for the same 2(n - 1)/n of the buffer each way when n is a power
of two; other world sizes fold their surplus ranks in first (testbed.collectives.halving_doubling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.collectives.halving_doubling import halving_doubling_allreduce_, scratch_elems
from testbed.costs import halving_doubling
from testbed.sync.flat import FlatGradSynchronizer
from testbed.sync.spec import BucketedSyncConfig, SimModel, SyncSpec, require_gloo_cpu


@dataclass
class HalvingDoublingSyncConfig(BucketedSyncConfig):
    name: str = "halving_doubling"


class HalvingDoublingAllReduce(FlatGradSynchronizer):
    def make_scratch(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(max(1, scratch_elems(flat.numel(), self.world.world_size)), dtype=flat.dtype, device=flat.device)

    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        traffic = halving_doubling_allreduce_(flat, scratch=scratch)
        return traffic.sent, traffic.recv


SPEC = SyncSpec(
    name="halving_doubling", schema=HalvingDoublingSyncConfig, impl=HalvingDoublingAllReduce, compresses=True,
    sim=SimModel(series=lambda cfg: "halving_doubling", cost=lambda cfg: lambda s: halving_doubling(int(cfg.world_size), s)),
    check=lambda cfg: require_gloo_cpu(cfg, "sync=halving_doubling"),
    inelastic=None,
)
