"""The backend's own all-reduce: Gloo on CPU, NCCL on CUDA (the baseline for every comparison)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from testbed.costs import ring
from testbed.sync.flat import FlatGradSynchronizer, InFlight, Traffic
from testbed.sync.spec import BucketedSyncConfig, SimModel, SyncSpec, node_ordered_ring
from testbed.timing import Stamp, stamp


class NcclAlgo(enum.Enum):
    Ring = "Ring"
    Tree = "Tree"


@dataclass
class AllReduceSyncConfig(BucketedSyncConfig):
    name: str = "allreduce"
    # Forces NCCL's algorithm (exported as NCCL_ALGO before the communicator exists); ignored by Gloo.
    nccl_algo: NcclAlgo | None = None


class NativeAllReduce(FlatGradSynchronizer):
    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        if self.world.world_size == 1:
            return 0, 0
        dist.all_reduce(flat)
        return self._moved(flat)

    def launch(self, index: int) -> InFlight:
        # Straight to the backend, which runs it on its own threads (Gloo) or stream (NCCL), as DDP
        # does: several buckets can be in flight at once, and no Python thread is woken per bucket.
        # A codec's encode and decode are Python: they run on the communication thread.
        if self.codecs is not None:
            return super().launch(index)
        flat = self.buckets[index].view
        return _AsyncAllReduce(dist.all_reduce(flat, async_op=True), *self._moved(flat), flat.device)

    def allgather_payload(self, payload: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        gathered = torch.empty(self.world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        dist.all_gather_into_tensor(gathered, payload)
        moved = (self.world_size - 1) * payload.numel() * payload.element_size()  # a ring allgather's
        return gathered, moved, moved

    def _moved(self, flat: torch.Tensor) -> tuple[int, int]:
        # The backend does not report its traffic; count what a bandwidth-optimal algorithm (ring)
        # must move, 2(n-1)/n of the buffer each way, which Gloo's and NCCL's ring do move.
        n = self.world.world_size
        moved = 2 * (n - 1) * flat.numel() * flat.element_size() // n
        return moved, moved

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["backend"] = self.world.backend
        if self.world.backend == "nccl":
            facts["nccl_algo"] = os.environ.get("NCCL_ALGO", "auto")
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        return facts


class _AsyncAllReduce:
    """An all-reduce the backend runs; completion is stamped by the backend's own callback. Gloo
    calls it from its thread when the collective is done; NCCL at once, on a stream that waits
    for the collective, so that the stamp (an event on that stream) fires when it is done."""

    def __init__(self, work: dist.Work, sent: int, recv: int, device: torch.device) -> None:
        self._work, self._sent, self._recv, self._device = work, sent, recv, device
        self._start = stamp(device)
        self._end: Stamp | None = None
        work.get_future().add_done_callback(self._done)

    def _done(self, _future: torch.futures.Future) -> None:
        self._end = stamp(self._device)

    def result(self) -> Traffic:
        self._work.wait()
        return Traffic(self._sent, self._recv, self._start, stamp(self._device) if self._end is None else self._end)


# Gloo's all-reduce of large buffers is a ring; the calibration fits the backend's own as "native".
# Gloo's CPU all-reduce is a ring (NCCL's between nodes too, where it picks Ring).
NATIVE = SimModel(series=lambda cfg: "native", cost=lambda cfg: lambda s: ring(int(cfg.world_size), s),
                  two_level=node_ordered_ring)

SPEC = SyncSpec(
    name="allreduce", schema=AllReduceSyncConfig, impl=NativeAllReduce, sim=NATIVE, compresses=True,
    rank_env=lambda cfg: {"NCCL_ALGO": str(cfg.sync.nccl_algo)} if cfg.sync.get("nccl_algo") else {},
    inelastic=None,
)
