"""A BytePS-style parameter server (Jiang et al., OSDI 2020): summation-only servers, workers that
run their own optimizers, and a node's ranks that reduce-scatter before they push.

A node of L ranks first ring-reduce-scatters its gradients, so that rank l holds the node's sum of
chunk c = (l + 1) mod L; it pushes that chunk, cut into one piece per server machine, to the shards
that sum piece and chunk over the N nodes (a server machine runs one shard per chunk, so each shard
sums whole pushes of N workers: one rank of each node); it pulls the mean back into the chunk, and
a ring all-gather inside the node hands every rank the whole mean gradient, which its optimizer
steps with (BytePS's servers keep no optimizer state: summation is all a CPU machine must do).

Across machines a node sends M and receives M per step however many nodes there are, when the
servers have machines of their own (``sync.servers`` = k > 0), where a flat ring sends
2(n - 1)/n · M from each of its ranks. With ``sync.servers=0`` the servers sit on the worker nodes,
one per node: the piece a node serves itself stays inside it, so its link carries 2(N - 1)/N · M
each way, as hierarchical all-reduce. A shard updates and streams its range in partitions of
``sync.partition_kb``, pushes folded in as they arrive, and a pull open beside its push streams
each partition back once every worker has pushed it: push and pull share the link's two directions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from testbed.checks import require, resolved_device
from testbed.collectives.common import chunk_bounds
from testbed.collectives.hierarchical import node_groups, node_size
from testbed.collectives.ring import ring_allgather_chunks_, ring_reduce_scatter_
from testbed.costs import ZERO, Cost, Link, parameter_server, ring
from testbed.ps.modes import MAX_CHUNK_KB
from testbed.sync.base import Synchronizer, SyncReport, flat_views
from testbed.sync.spec import Servers, SimModel, SyncBase, SyncSpec, ranks_per_node, require_gloo_cpu
from testbed.world import World

# BytePS partitions in 4 MB (BYTEPS_PARTITION_BYTES), for 100 MB models. A pull overlaps its push
# only from its shard's second partition, so the testbed's smaller models take 1 MB, the parameter
# server's chunk (2 x 2 over 1 Gbit, 15.8 MB of gradients, k = 2: 334 ms a sync at 4 MB, 248 at 1 MB).
PARTITION_KB = 1024


@dataclass
class BytePsSyncConfig(SyncBase):
    name: str = "byteps"
    # Machines of summation servers; 0: a server on each worker node (network.servers does not apply).
    servers: int = 1
    partition_kb: int = PARTITION_KB  # the shards' unit of summation and of the pull's stream
    ranks_per_node: int | None = None  # null: the ranks of one machine (LOCAL_WORLD_SIZE)
    host: str = "127.0.0.1"  # address local servers bind to
    addresses: list[str] = field(default_factory=list)  # written by the launcher: one per shard


@dataclass(frozen=True)
class Layout:
    """Nodes of ``per_node`` ranks and ``machines`` server machines of ``per_node`` shards each:
    shard ``machine * per_node + chunk`` sums piece ``machine`` of chunk ``chunk``."""

    nodes: int
    per_node: int
    machines: int

    @property
    def shards(self) -> int:
        return self.machines * self.per_node

    def chunk_of(self, local_rank: int) -> int:
        return (local_rank + 1) % self.per_node  # what the node's ring reduce-scatter leaves it

    def shards_of(self, local_rank: int) -> list[int]:
        chunk = self.chunk_of(local_rank)
        return [m * self.per_node + chunk for m in range(self.machines)]


def layout(cfg: Any) -> Layout:
    per_node = ranks_per_node(cfg)
    nodes = int(cfg.world_size) // per_node
    return Layout(nodes, per_node, int(cfg.sync.servers) or nodes)


def server_machines(cfg: Any) -> list[int]:
    """The machine of each shard on a two-level network: worker nodes 0..N-1, then server machines."""
    lay, nodes = layout(cfg), int(cfg.network.nodes)
    if not int(cfg.sync.servers):
        return [s // lay.per_node for s in range(lay.shards)]
    separate = cfg.network.servers == "separate"
    return [nodes + s // lay.per_node if separate else (s // lay.per_node) % nodes for s in range(lay.shards)]


class BytePsSync(Synchronizer):
    waits_for_peers = False  # the shards report how long they held each pull back (t_wait)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        from testbed.ps.client import PsClient  # gRPC loads on the ranks that use it
        from testbed.ps.wire import token_from_env

        super().setup(model, optimizer, world)
        per_node = node_size(self.cfg.ranks_per_node, world.world_size, world.local_world_size, "sync=byteps")
        nodes = world.world_size // per_node
        self.layout = Layout(nodes, per_node, int(self.cfg.servers) or nodes)
        node, local = divmod(world.rank, per_node)
        groups = [dist.new_group(ranks) for ranks in node_groups(world.world_size, per_node)[0]]  # all, in order
        self.intra = groups[node]
        _, self.flat_grads = flat_views(model, world.device)
        lo, hi = chunk_bounds(self.flat_grads.numel(), per_node)[self.layout.chunk_of(local)]
        self.chunk = self.flat_grads[lo:hi]
        if self.chunk.numel() < self.layout.machines:
            raise ValueError(f"sync=byteps: a chunk of {self.chunk.numel()} gradients cannot be cut for "
                             f"{self.layout.machines} server machines; use fewer servers or a larger model")
        self.pieces = [self.chunk[a:b] for a, b in chunk_bounds(self.chunk.numel(), self.layout.machines)]
        shards = self.layout.shards_of(local)
        addresses = [self.cfg.addresses[s] for s in shards]
        self.client = PsClient(addresses, token_from_env(), node, world.timeout_s, int(self.cfg.partition_kb) * 1024,
                               shards=shards)
        infos = self.client.register(wait_s=world.timeout_s)
        for shard, info in zip(shards, infos):
            if info.workers != nodes:
                raise ValueError(f"byteps shard {shard} expects {info.workers} workers; this run has {nodes} nodes")
        if node == 0 and infos[0].version == 0:  # the shards learn their sizes; the values are the first sum's
            self.client.init_params(self.pieces)
        dist.barrier()
        self.clock = int(infos[0].version)
        self.versions = [int(info.version) for info in infos]
        self.bytes_per_chunk = self.chunk.numel() * self.chunk.element_size()

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        traffic = ring_reduce_scatter_(self.flat_grads, self.intra)
        self.chunk.div_(self.layout.per_node)  # the shards average over nodes: the mean over every rank
        self.clock += 1
        pulled = self.client.push_pull(self.pieces, self.versions, self.clock)
        self.versions = pulled.versions
        traffic += ring_allgather_chunks_(self.flat_grads, self.intra)
        return SyncReport(bytes_sent=traffic.sent + self.bytes_per_chunk, bytes_recv=traffic.recv + self.bytes_per_chunk,
                          t_wait=pulled.blocked_s)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def describe(self) -> dict[str, Any]:
        from testbed.ps.client import describe_stats

        return {"nodes": self.layout.nodes, "ranks_per_node": self.layout.per_node,
                "server_machines": self.layout.machines, "colocated": not int(self.cfg.servers),
                "partition_kb": int(self.cfg.partition_kb), "server_stats": describe_stats(self.client.stats())}

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()


def label(sync: Mapping[str, Any]) -> str:
    return f"byteps k={sync.get('servers', 1)}"


def _check(cfg: Any) -> None:
    sync = cfg.sync
    per_node = sync.ranks_per_node
    require(per_node is None or (per_node >= 1 and cfg.world_size % per_node == 0),
            f"sync.ranks_per_node={per_node}: a divisor of world_size={cfg.world_size} (null: one machine's ranks)")
    require(sync.servers >= 0, f"sync.servers={sync.servers}: server machines, >= 0 (0: one on each worker node)")
    require(1 <= sync.partition_kb <= MAX_CHUNK_KB,
            f"sync.partition_kb={sync.partition_kb}: must be in [1, {MAX_CHUNK_KB}] (partitions stay under the message limit)")
    require(not sync.addresses, "sync=byteps starts its servers itself (one per chunk of a node on each server "
                                "machine); drop sync.addresses")
    require(resolved_device(cfg) == "cpu", "sync=byteps exchanges host memory: use device=cpu")
    require_gloo_cpu(cfg, "sync=byteps's reduce-scatter inside a node")
    require(not (cfg.checkpoint.every or cfg.resume),
            "checkpoint/resume with sync=byteps is not built yet: the shards' versions are not saved with the workers'")


@contextmanager
def _start_servers(
    plain: dict[str, Any], world_size: int, log_dir: Path, hosts: list[tuple[str, str]] | None,
    saving: tuple[Path, int] | None, restore: Path | None,
) -> Iterator[dict[str, str]]:
    from omegaconf import OmegaConf

    from testbed.ps.launch import LocalServers

    lay = layout(OmegaConf.create(plain))
    shards = {"servers": lay.shards, "host": plain["sync"]["host"], "mode": "sync", "staleness": 0,
              "chunk_kb": plain["sync"]["partition_kb"], "sums_only": True}
    with LocalServers(shards, plain["optim"], lay.nodes, log_dir, hosts) as ps:
        plain["sync"]["addresses"] = ps.addresses
        yield ps.rank_env()


def _partitions(cfg: Any, lay: Layout, s: float) -> int:
    """Partitions of each shard's piece of ``s`` gradient bytes."""
    return max(1, math.ceil(s / lay.per_node / lay.machines / (int(cfg.sync.partition_kb) * 1024)))


def _cost(cfg: Any) -> Callable[[float], Cost]:
    """On links that are all alike (each shard its own): the node's ring reduce-scatter and
    all-gather, and each chunk's push and pull through its machines' shards, overlapped over the
    shard's partitions."""
    lay = layout(cfg)
    colocated = not int(cfg.sync.servers)

    def cost(s: float) -> Cost:
        inside = ring(lay.per_node, s) if lay.per_node > 1 else ZERO
        return inside + parameter_server(lay.nodes, s / lay.per_node, servers=lay.machines, colocated=colocated,
                                         overlap_push_pull=True, partitions=_partitions(cfg, lay, s))

    return cost


def _two_level(cfg: Any) -> Callable[[float, Link, Link], float]:
    """Inside the node on its links; across, each node's chunks together are its whole gradient
    through its uplink, to server machines whose uplinks carry N M / k each way."""
    lay = layout(cfg)
    colocated = not int(cfg.sync.servers)

    def seconds(s: float, intra: Link, inter: Link) -> float:
        inside = ring(lay.per_node, s).time(intra) if lay.per_node > 1 else 0.0
        across = parameter_server(lay.nodes, s, servers=lay.machines, colocated=colocated, overlap_push_pull=True,
                                  partitions=_partitions(cfg, lay, s))
        return inside + across.time(inter)

    return seconds


SPEC = SyncSpec(
    name="byteps", schema=BytePsSyncConfig, impl=BytePsSync, check=_check, label=label,
    sim=SimModel(series=lambda cfg: "ps_k1", cost=_cost, two_level=_two_level),
    servers=Servers(
        count=lambda cfg: layout(cfg).shards,
        start=_start_servers,
        apart="its summation servers are started by the launcher only; run it without torchrun/Slurm",
        machines=server_machines,
    ),
    communicates_alone=True, no_codec="sync=byteps carries no codec yet (BytePS's compression plugins are not built)",
    inelastic="its summation service folds each push in as it arrives, so a step short of a lost worker's push "
              "cannot be dropped and pushed again",
)
