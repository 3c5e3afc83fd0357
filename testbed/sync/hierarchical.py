"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes, all-gather
inside (testbed.collectives.hierarchical), bucketed and overlapped like the flat family.

A node is ``sync.ranks_per_node`` consecutive ranks, by default the ranks of one machine: torchrun's
and Slurm's ``LOCAL_WORLD_SIZE``, or an emulated two-level network's (``network.nodes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.checks import require
from testbed.collectives.hierarchical import hierarchical_allreduce_, node_groups, node_size
from testbed.collectives.registry import BETWEEN_NODES, COLLECTIVES, Setting
from testbed.costs import Cost, Link, ring, shared
from testbed.sync.flat import FlatGradSynchronizer
from testbed.sync.spec import BucketedSyncConfig, SimModel, SyncSpec, ranks_per_node, require_gloo_cpu
from testbed.world import World


@dataclass
class HierarchicalSyncConfig(BucketedSyncConfig):
    name: str = "hierarchical"
    inter: str = "ring"  # the all-reduce across nodes: one of the registry's BETWEEN_NODES
    ranks_per_node: int | None = None  # null: the ranks of one machine (LOCAL_WORLD_SIZE)


class HierarchicalAllReduce(FlatGradSynchronizer):
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.per_node = per_node = node_size(self.cfg.ranks_per_node, world.world_size, world.local_world_size,
                                             "sync=hierarchical")
        nodes, across = node_groups(world.world_size, per_node)
        # Every rank creates every group, in the same order (torch.distributed's rule).
        self.intra = self._mine([dist.new_group(ranks) for ranks in nodes], nodes)
        self.inter = self._mine([dist.new_group(ranks) for ranks in across], across)

    def _mine(self, groups: list[Any], members: list[list[int]]) -> Any:
        return next(g for g, ranks in zip(groups, members) if self.world.rank in ranks)

    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        traffic = hierarchical_allreduce_(flat, self.intra, self.inter, self.cfg.inter)
        return traffic.sent, traffic.recv

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "ranks_per_node": self.per_node, "nodes": self.world.world_size // self.per_node,
                "inter": self.cfg.inter}


def _across(cfg: Any) -> Callable[[int, float], Cost]:
    """The cost of ``sync.inter`` over (nodes, bytes)."""
    spec = COLLECTIVES[cfg.sync.inter]
    return lambda nodes, nbytes: spec.cost(nodes, nbytes, Setting().chunk_bytes)


def _cost(cfg: Any) -> Callable[[float], Cost]:
    """On links that are all alike: the node's ring reduce-scatter and all-gather, and the shard's
    all-reduce across nodes."""
    n, per_node = int(cfg.world_size), ranks_per_node(cfg)
    inter = _across(cfg)

    def cost(s: float) -> Cost:
        total = ring(per_node, s) if per_node > 1 else Cost(0, 0, 0)
        return total + inter(n // per_node, s / per_node) if n > per_node else total

    return cost


def _two_level(cfg: Any) -> Callable[[float, Link, Link], float]:
    """Inside the node on its links; across, the node's ranks each all-reduce their shard at once,
    so their flows share its uplink."""
    n, per_node = int(cfg.world_size), ranks_per_node(cfg)
    inter = _across(cfg)

    def seconds(s: float, intra_link: Link, inter_link: Link) -> float:
        inside = ring(per_node, s).time(intra_link) if per_node > 1 else 0.0
        return inside + (shared(inter(n // per_node, s / per_node), per_node).time(inter_link) if n > per_node else 0.0)

    return seconds


def _check(cfg: Any) -> None:
    require(cfg.sync.inter in BETWEEN_NODES, f"sync.inter={cfg.sync.inter}: one of {'|'.join(BETWEEN_NODES)}")
    per_node = cfg.sync.ranks_per_node
    require(per_node is None or (per_node >= 1 and cfg.world_size % per_node == 0),
            f"sync.ranks_per_node={per_node}: a divisor of world_size={cfg.world_size} (null: one machine's ranks)")
    require_gloo_cpu(cfg, "sync=hierarchical")


SPEC = SyncSpec(name="hierarchical", schema=HierarchicalSyncConfig, impl=HierarchicalAllReduce, check=_check,
                compresses=True, sim=SimModel(series=lambda cfg: "ring", cost=_cost, two_level=_two_level),
                inelastic="its two-level groups follow the machines, which a new membership does not re-plan")
