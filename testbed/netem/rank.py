"""What a process spawned into an emulated network does first: enter its namespace, find its peers.

The launcher passes the plan through the environment (``TESTBED_NETNS``: JSON with each rank's
namespace and address). Entering uses setns(2) on ``/run/netns/<name>``; threads and sockets
created afterwards live in that namespace. The process group's store then runs on rank 0's
emulated address instead of the launcher's loopback store, which the namespace cannot reach.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from testbed.latency import set_latency_ms
from testbed.world import LAUNCHER_STORE_ENV, LOOPBACK_STORE_ENV, bound_store

NETNS_ENV = "TESTBED_NETNS"
STORE_PORT = 29500  # each run has its own network stack, so a fixed port cannot collide
CLONE_NEWNET = 0x40000000


def enter_namespace(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def namespace_store(namespace: str, address: str, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore served on ``address`` (a free port, its ``.port``) inside network namespace
    ``namespace``, by a process that stays outside it: built on a thread that enters the namespace,
    so that its listening socket, its server's threads and its own client connection live there."""
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            enter_namespace(namespace)
            built["store"] = bound_store(0, None, timeout, host=address)
        except BaseException as exc:  # raised again on the caller's thread
            built["error"] = exc

    thread = threading.Thread(target=build, name="testbed-store")
    thread.start()
    thread.join()
    if "error" in built:
        raise built["error"]
    return built["store"]


def rank_plan() -> dict[str, Any] | None:
    spec = os.environ.get(NETNS_ENV)
    return json.loads(spec) if spec else None


def enter_rank_namespace() -> None:
    """Move this rank into its emulated host, if the launcher made a network; call before any socket."""
    plan = rank_plan()
    if plan is None:
        return
    rank = int(os.environ["RANK"])
    enter_namespace(plan["ranks"][rank]["namespace"])
    set_latency_ms(float(plan["latency_ms"]))
    os.environ["GLOO_SOCKET_IFNAME"] = plan["interface"]
    # The store is rank 0's on its emulated address, which the other namespaces reach (a private
    # network), not on loopback; or the elastic launcher's, which it serves in a namespace of its own
    # on the same network (namespace_store), and whose address it gave.
    if os.environ.get(LAUNCHER_STORE_ENV) != "1":
        os.environ.update(MASTER_ADDR=plan["ranks"][0]["address"], MASTER_PORT=str(STORE_PORT))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.pop(LOOPBACK_STORE_ENV, None)
    machines = plan.get("machines")
    if machines is not None:  # two levels: this machine's ranks are the local ones
        mine = [r for r, m in enumerate(machines) if m == machines[rank]]
        os.environ.update(LOCAL_RANK=str(mine.index(rank)), LOCAL_WORLD_SIZE=str(len(mine)))
