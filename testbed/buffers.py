"""One policy for module buffers (BatchNorm's running statistics) under every synchronizer.

Synchronizers average gradients (or parameters) only, so each replica's running statistics
follow its own shard and drift apart. Whenever a step leaves the replicas' parameters equal
(``SyncReport.replicas_agree``: every step of the synchronous ones, each averaging step of local
SGD, never during asynchronous or bounded-staleness parameter-server training) the floating-point
buffers are made equal too, through the world's process group, and once more after the last step:

- ``broadcast`` (the default, DDP's ``broadcast_buffers``): every rank takes rank 0's buffers, so
  the statistics are those rank 0 computed over its own batches;
- ``average``: the mean over ranks; running means then equal those of the global batch (with
  equal shards), running variances miss the spread between the ranks' means;
- ``local``: left alone (the replica check then reports differing buffers).

Integer buffers (``num_batches_tracked``) advance alike on every rank: all run the same steps.
The buffers are views into one flat tensor per dtype, so a synchronization is one collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class BufferSync:
    def __init__(self, model: nn.Module, policy: str, world_size: int) -> None:
        self.policy, self.world_size = policy, world_size
        self.flats: list[torch.Tensor] = []
        owners = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        floating = [(m, name, b) for m, name, b in owners if b.is_floating_point()]
        if policy == "local" or world_size == 1 or not floating:
            return
        for dtype in sorted({b.dtype for _, _, b in floating}, key=str):
            group = [(m, name, b) for m, name, b in floating if b.dtype == dtype]
            flat = torch.cat([b.detach().reshape(-1) for _, _, b in group])
            offset = 0
            for module, name, b in group:
                module._buffers[name] = flat[offset : offset + b.numel()].view_as(b)  # BatchNorm updates in place
                offset += b.numel()
            self.flats.append(flat)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats)

    def sync(self) -> int:
        """Make the buffers equal on every rank; return the bytes this rank sent."""
        for flat in self.flats:
            if self.policy == "broadcast":
                dist.broadcast(flat, src=0)
            else:
                dist.all_reduce(flat)
                flat.div_(self.world_size)
        return self.nbytes

    def describe(self) -> dict[str, object]:
        return {"policy": self.policy, "synchronized_bytes": self.nbytes}
