"""Explicit tree all-reduce, pipelined, optionally a double binary tree (testbed.collectives.tree)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.checks import require
from testbed.collectives.tree import SCRATCH_CHUNKS, tree_allreduce_
from testbed.costs import Cost, pipelined_tree, two_tree_reduce_broadcast
from testbed.sync.flat import FlatGradSynchronizer
from testbed.sync.spec import BucketedSyncConfig, SimModel, SyncSpec, require_gloo_cpu
from testbed.world import World


@dataclass
class TreeSyncConfig(BucketedSyncConfig):
    name: str = "tree"
    # Pipelining granularity: the buffer moves up and down the tree in chunks of this size.
    chunk_kb: int = 512
    # Two complementary binary trees, each carrying half the buffer (NCCL's double binary tree).
    double: bool = True


class TreeAllReduce(FlatGradSynchronizer):
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        # The second tree's own connections (testbed.collectives.tree says why).
        self.second_group = dist.new_group() if self.cfg.double and world.world_size > 1 else None

    def _chunk_elems(self, flat: torch.Tensor) -> int:
        # Capped at half the buffer (each tree's segment), so small gradients get small scratch.
        return max(1, min(self.cfg.chunk_kb * 1024 // flat.element_size(), -(-flat.numel() // 2)))

    def make_scratch(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(SCRATCH_CHUNKS * self._chunk_elems(flat), dtype=flat.dtype, device=flat.device)

    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        traffic = tree_allreduce_(flat, chunk_elems=self._chunk_elems(flat), double=self.cfg.double, scratch=scratch,
                                  second_group=self.second_group)
        return traffic.sent, traffic.recv

    def describe(self) -> dict[str, Any]:
        kind = "double binary" if self.cfg.double else "binary"
        return {**super().describe(), "tree": kind, "chunk_kb": self.cfg.chunk_kb}


def _cost(cfg: Any) -> Callable[[float], Cost]:
    n, chunk = int(cfg.world_size), int(cfg.sync.chunk_kb) * 1024
    if not cfg.sync.get("double", True):
        return lambda s: pipelined_tree(n, s, max(1, math.ceil(s / chunk)))
    return lambda s: two_tree_reduce_broadcast(n, s, chunk)


def _check(cfg: Any) -> None:
    require(cfg.sync.chunk_kb >= 1, f"sync.chunk_kb={cfg.sync.chunk_kb}: must be >= 1")
    require_gloo_cpu(cfg, "sync=tree")


SPEC = SyncSpec(name="tree", schema=TreeSyncConfig, impl=TreeAllReduce, check=_check, compresses=True,
                sim=SimModel(series=lambda cfg: "tree", cost=_cost),
                inelastic=None)
