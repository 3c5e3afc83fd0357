"""Explicit ring all-reduce over point-to-point send/recv (testbed.collectives.ring)."""

from __future__ import annotations

from typing import Optional

import torch

from testbed.collectives import chunk_bounds, ring_allreduce_
from testbed.sync import register
from testbed.sync.base import FlatGradSynchronizer


@register("ring")
class RingAllReduce(FlatGradSynchronizer):
    def make_scratch(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = chunk_bounds(flat.numel(), self.world.world_size)[0]
        return torch.empty(max(1, hi - lo), dtype=flat.dtype, device=flat.device)

    def allreduce_(self, flat: torch.Tensor, scratch: Optional[torch.Tensor]) -> tuple[int, int]:
        traffic = ring_allreduce_(flat, scratch=scratch)
        return traffic.sent, traffic.recv
