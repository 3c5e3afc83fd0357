"""The backend's own all-reduce: Gloo on CPU, NCCL on CUDA (the baseline for every comparison)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from testbed.sync import register
from testbed.sync.base import FlatGradSynchronizer


@register("allreduce")
class NativeAllReduce(FlatGradSynchronizer):
    def allreduce_(self, flat: torch.Tensor, scratch: Optional[torch.Tensor]) -> tuple[int, int]:
        n = self.world.world_size
        if n == 1:
            return 0, 0
        dist.all_reduce(flat)
        # The backend does not report its traffic; count what a bandwidth-optimal algorithm (ring)
        # must move, 2(n-1)/n of the buffer each way, which Gloo's and NCCL's ring do move.
        moved = 2 * (n - 1) * flat.numel() * flat.element_size() // n
        return moved, moved

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["backend"] = self.world.backend
        if self.world.backend == "nccl":
            facts["nccl_algo"] = os.environ.get("NCCL_ALGO", "auto")
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        return facts
