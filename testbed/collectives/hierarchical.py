"""Hierarchical all-reduce (Horovod's): reduce-scatter inside each node, all-reduce of each rank's
shard across the nodes, all-gather inside the node.

With N nodes of L ranks each, rank l of a node ends the reduce-scatter holding its node's sum of
chunk (l + 1) mod L; the N ranks that hold the same chunk (one per node, the same local rank) sum
it across nodes; the all-gather spreads the result. Across nodes each rank moves 2(N - 1)/N of
M / L, so a node's link carries 2(N - 1)/N · M in all, where a flat ring would send that from
every one of its L ranks. Ranks are numbered node by node (rank = node · L + local rank), as
torchrun and the emulated two-level network place them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from testbed.checks import ConfigError
from testbed.collectives.common import Traffic, chunk_bounds
from testbed.collectives.registry import Setting, collective
from testbed.collectives.ring import ring_allgather_chunks_, ring_reduce_scatter_

Group = dist.ProcessGroup | None


def node_size(given: int | None, world_size: int, local_world_size: int, what: str) -> int:
    """The ranks of a node: ``given`` (sync.ranks_per_node), else this machine's; they must divide
    the world (``what`` names the synchronizer in the refusal)."""
    per_node = int(given or local_world_size)
    if world_size % per_node:
        raise ConfigError(f"{what}: {per_node} ranks per node do not divide world_size={world_size}")
    return per_node


def node_groups(world_size: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks of each local rank across nodes)."""
    nodes = [list(range(k * per_node, (k + 1) * per_node)) for k in range(world_size // per_node)]
    return nodes, [list(ranks) for ranks in zip(*nodes)]


def hierarchical_allreduce_(buf: torch.Tensor, intra: Group, inter: Group, across: str = "ring") -> Traffic:
    """Sum ``buf`` (1-D) over every rank in place: ``intra`` is this rank's node, ``inter`` the
    ranks of its local rank on the other nodes, ``across`` the algorithm between nodes (one of the
    registry's ``BETWEEN_NODES``)."""
    size, local = dist.get_world_size(intra), dist.get_rank(intra)
    traffic = ring_reduce_scatter_(buf, intra)
    lo, hi = chunk_bounds(buf.numel(), size)[(local + 1) % size]
    if hi > lo and dist.get_world_size(inter) > 1:
        traffic += collective(across, "sync.inter").run(buf[lo:hi], None, Setting(group=inter))
    traffic += ring_allgather_chunks_(buf, intra)
    return traffic
