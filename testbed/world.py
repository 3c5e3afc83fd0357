"""The world a rank lives in: who it is, where it computes, how it talks, and one shared clock.

Built once per rank from the environment that torch's elastic launcher, torchrun or Slurm set
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Set by the local launcher (testbed.launch.spawn): rank 0 serves the ranks' store on loopback only.
LOOPBACK_STORE_ENV = "TESTBED_LOOPBACK_STORE"
# Set by the elastic launcher (testbed.launch.supervisor): it serves the store, every rank is a client.
LAUNCHER_STORE_ENV = "TESTBED_LAUNCHER_STORE"


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout_s: float
    # Seconds to add to this rank's time.time() to get rank 0's clock (0 on one machine, up to the
    # start-up estimate's error across machines); every absolute timestamp in the metrics uses it.
    clock_offset_s: float = 0.0
    store: dist.Store | None = None  # the process group's key-value store (testbed.stall posts arrivals there)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank_layout() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun-style or Slurm variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    else:
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    return rank, local_rank, world_size, local_world


# `debug=true`: torch.distributed checks every collective's shapes across ranks and reports
# desynchronized ranks (DETAIL), logs its C++ side, and NCCL explains itself.
DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO", "NCCL_DEBUG": "INFO",
             "TORCH_NCCL_DESYNC_DEBUG": "1"}


def init_world(device_kind: str, backend: str, timeout_s: float, debug: bool = False) -> World:
    """Join the process group named by the environment and agree on a clock."""
    if debug:  # read when the process group is created
        for key, value in DEBUG_ENV.items():
            os.environ.setdefault(key, value)
    rank, local_rank, world_size, local_world = env_rank_layout()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    device = rank_device(device_kind, local_rank)
    store = _store(rank, world_size, timedelta(seconds=timeout_s))  # kept: the stall check posts to it
    return form_world(store, "default_pg", rank, world_size, device, backend, timeout_s, local_rank, local_world)


def rank_device(device_kind: str, local_rank: int) -> torch.device:
    """The rank's device, made current. Under gloo more local ranks than GPUs share them
    round-robin (config refuses NCCL without one GPU per local rank)."""
    if device_kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def form_world(store: dist.Store, prefix: str, rank: int, world_size: int, device: torch.device, backend: str,
               timeout_s: float, local_rank: int | None = None, local_world: int | None = None) -> World:
    """The default process group of ``world_size`` ranks over ``store``, its keys under ``prefix``
    (a new membership forms its group under a prefix of its own: testbed.elastic)."""
    timeout = timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    local_rank = rank if local_rank is None else local_rank
    local_world = world_size if local_world is None else local_world
    world = World(rank, local_rank, world_size, local_world, device, backend, timeout_s, store=store)
    offset = _clock_offset(world)
    return World(rank, local_rank, world_size, local_world, device, backend, timeout_s, offset, store)


def _store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The ranks' key-value store at ``MASTER_PORT``: as init_process_group makes it for env://
    (served by rank 0 on every interface, where the ranks of a multi-machine job reach it), or, in a
    local job (``LOOPBACK_STORE_ENV``), served by rank 0 on loopback only, since a store has no
    authentication; or, under the elastic launcher (``LAUNCHER_STORE_ENV``), the launcher's, which
    outlives any rank."""
    if os.environ.get(LAUNCHER_STORE_ENV) == "1":
        return launcher_store(timeout)
    if os.environ.get(LOOPBACK_STORE_ENV) != "1":
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        return store
    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        return bound_store(port, world_size, timeout)
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def launcher_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the elastic launcher's store (testbed.launch.supervisor), at ``MASTER_ADDR``:
    loopback, or its address on an emulated network."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                         timeout=timeout)


def bound_store(port: int, world_size: int | None, timeout: timedelta, host: str = "127.0.0.1") -> dist.TCPStore:
    """A TCPStore served on ``host:port`` (loopback by default; port 0: a free one, its ``.port``),
    waiting for ``world_size`` clients (None: for none). torch binds its own stores to every
    interface; given a socket bound by the caller, it serves on that one."""
    listening = socket.create_server((host, port), backlog=128)
    return dist.TCPStore(host, listening.getsockname()[1], world_size, is_master=True, timeout=timeout,
                         wait_for_workers=world_size is not None, multi_tenant=True,
                         master_listen_fd=listening.detach())  # the store owns the socket now


def _clock_offset(world: World) -> float:
    """Estimate this rank's clock offset to rank 0 with one broadcast after a barrier.

    The error is about one broadcast latency (sub-millisecond on a LAN); on one machine every rank
    reads the same clock and the estimate is discarded.
    """
    if world.world_size == 1:
        return 0.0
    stamp = torch.zeros(1, dtype=torch.float64, device=world.device)
    dist.barrier()
    if world.rank == 0:
        stamp.fill_(time.time())
    dist.broadcast(stamp, src=0)
    offset = float(stamp.item()) - time.time()
    return 0.0 if world.local_world_size == world.world_size else offset


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
