"""ZeRO stage 1 as torch ships it (``ZeroRedundancyOptimizer``): sync=zero_torch, the reference for
sync=zero stage 1.

Gradients are all-reduced by the backend; each rank steps the optimizer for the whole tensors
assigned to it (torch balances the ranks by tensor sizes, so one large weight unbalances them), and
each rank's updated parameters are broadcast from it. Its collectives run inside torch: the bytes
a step moves are counted as the bandwidth-optimal algorithms move them (2Ψ(n-1)/n for the
all-reduce, Ψ(n-1)/n for the broadcasts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.costs import ring, ring_allgather
from testbed.memory import Sharding, optimizer_tensors
from testbed.optim import follow, settings
from testbed.sharded_checkpoint import Pieces, Whole, optimizer_state
from testbed.sync.base import Synchronizer, SyncReport, flat_views
from testbed.sync.spec import SimModel, SyncBase, SyncSpec
from testbed.world import World


class TorchZero(Synchronizer):
    steps_optimizer = True

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().setup(model, optimizer, world)
        self.flat_params, self.flat_grads = flat_views(model, world.device)
        self.zero = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=type(optimizer), **settings(optimizer))
        n = world.world_size
        psi_bytes = self.flat_params.numel() * self.flat_params.element_size()
        self._bytes = 3 * (n - 1) * psi_bytes // n

    def _mine(self) -> list[nn.Parameter]:
        return [p for group in self.zero.optim.param_groups for p in group["params"]]

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        n = self.world.world_size
        if n > 1:
            dist.all_reduce(self.flat_grads)
            self.flat_grads.div_(n)
        follow(self.optimizer, self.zero)
        self.zero.step()
        return SyncReport(bytes_sent=self._bytes, bytes_recv=self._bytes)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def pieces(self) -> Pieces:
        names = {id(p): name for name, p in self.model.named_parameters()}
        out = Pieces()
        for p in self._mine():
            out.add(names[id(p)], 0, p.reshape(-1), self.zero.optim.state.get(p, {}), 0, p.numel())
        return out

    def restore(self, whole: Whole) -> None:
        names = {id(p): name for name, p in self.model.named_parameters()}
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(whole.params[names[id(p)]].view_as(p))
        for p in self._mine():
            state = optimizer_state(whole, [names[id(p)]], 0, p.numel(), p)
            if state:
                self.zero.optim.state[p] = state

    def held(self) -> dict[str, list[torch.Tensor | None]]:
        return {"params": [self.flat_params], "grads": [self.flat_grads], "optimizer": optimizer_tensors(self.zero.optim)}

    def sharding(self) -> Sharding:
        mine = self._mine()
        return Sharding(1, self.flat_params.numel(), sum(p.numel() for p in mine), self.flat_params.element_size(),
                        len(mine))

    def describe(self) -> dict[str, Any]:
        # Each rank's share of the elements: whole tensors, so not psi / n.
        partitions = self.zero._partition_parameters()  # torch has no public name for it
        return {"stage": 1, "impl": "torch",
                "shard_numel_by_rank": [sum(p.numel() for group in groups for p in group["params"]) for groups in partitions]}


@dataclass
class TorchZeroSyncConfig(SyncBase):
    name: str = "zero_torch"


SPEC = SyncSpec(
    name="zero_torch", schema=TorchZeroSyncConfig, impl=TorchZero,
    sim=SimModel(series=lambda cfg: "native", cost=lambda cfg: lambda s: ring(int(cfg.world_size), s) + ring_allgather(int(cfg.world_size), s),
                 overlap=lambda cfg: False),
    label=lambda sync: "zero-1 torch",
    no_codec="torch's ZeroRedundancyOptimizer carries no codec",
    averaged_gradient=lambda cfg: None,
    inelastic="each rank's shard of the optimizer state is not redistributed over a new membership",
    sharded_checkpoint=True,
)
