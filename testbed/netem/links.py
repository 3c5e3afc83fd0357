"""The emulated network of one run: a namespace per endpoint (rank or server), a bridge, shaped links.

Flat: namespace ``<prefix>-sw`` holds bridge ``br0``; each endpoint ``e`` gets namespace
``<prefix>-<e>`` with interface ``eth0`` (address ``10.78.0.x/24``) whose veth peer is a port of the
bridge. ``tc tbf`` shapes both directions of every link: egress of ``eth0`` (the endpoint's
upload) and egress of the bridge port (its download). Nothing touches the root namespace.

Two-level (``machines``: endpoint -> machine): each machine is namespace ``<prefix>-m<k>`` with a
bridge of its own, to which its endpoints' ``eth0`` peers attach (unshaped, or at
``intra_bandwidth``), and one ``uplink`` to the switch (port ``m<k>``) shaped at ``bandwidth``
both ways: the machine's NIC, which all its endpoints' traffic to other machines shares.

Names are ``tb<launcher pid>n<sequence>-<endpoint>``, so leftovers of a launcher that died (SIGKILL
leaves no chance to clean up) are recognisable: ``remove_leftovers`` deletes those whose launcher
is gone, and each new network does that first. ``python -m testbed.netem cleanup`` runs it by hand.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Any

from testbed.netem.rank import NETNS_ENV

SUBNET = "10.78.0"
INTERFACE = "eth0"
UPLINK = "uplink"  # a machine's interface to the switch
MAX_ENDPOINTS = 250
LAUNCHER_ENDPOINT = "l"  # the elastic launcher's store (testbed.launch.supervisor), on a link like a rank's
# Each shaped port queues up to this much of its line rate (tbf's latency). At 5 ms (62 KB at
# 100 Mbit) the pushes of two workers converging on one server overflowed it, and the lost packets
# stalled for TCP's 200 ms minimum retransmission timeout: the sharded PS measured half its bound.
QUEUE = "20ms"
_NAME = re.compile(r"^tb(\d+)n\d+-")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_sequence = itertools.count()


PLACEMENTS = ("separate", "colocated")


def machines_of(world_size: int, servers: int, nodes: int, placement: str,
                server_machines: list[int] | None = None) -> dict[str, int] | None:
    """Which machine each endpoint is on: ranks in contiguous blocks over ``nodes`` machines, shards
    (``s<k>``) on machines of their own after them (``separate``) or on node k mod nodes
    (``colocated``), or on ``server_machines[k]`` where the synchronizer places them; None for a
    flat network (``nodes`` = 0)."""
    if nodes == 0:
        return None
    per_node = world_size // nodes
    machines = {f"r{r}": r // per_node for r in range(world_size)}
    if server_machines is None:
        server_machines = [nodes + k if placement == "separate" else k % nodes for k in range(servers)]
    machines.update({f"s{k}": m for k, m in enumerate(server_machines)})
    return machines


def shape(rate: str) -> list[str]:
    """tc's arguments for a port shaped at ``rate``: a token bucket, which needs a bucket of at least
    one timer tick of traffic (2 ms of line rate, >= 64 KiB)."""
    burst = str(max(64 * 1024, int(parse_rate(rate) / 8 / 500)))
    return ["root", "tbf", "rate", rate, "burst", burst, "latency", QUEUE]


class NetworkUnavailable(RuntimeError):
    """The machine cannot build emulated links (not root, or iproute2 missing)."""


def parse_rate(rate: str) -> float:
    """``100mbit`` -> bits per second; ValueError for anything tc would not read the same way."""
    match = _RATE.match(rate.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{rate!r}: expected <number><bit|kbit|mbit|gbit>, e.g. 100mbit or 1gbit")
    return float(match.group(1)) * _UNIT[match.group(2)]


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetworkUnavailable("network=emulated creates network namespaces and needs root; run as root or use network=loopback")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkUnavailable(f"network=emulated needs iproute2 ({', '.join(missing)} not found); install iproute2 or use network=loopback")


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(everything: bool = False) -> list[str]:
    """Delete the testbed's namespaces whose launcher is gone (all of them with ``everything``).

    Ranks and servers orphaned inside them are killed first: a namespace lives on while any
    process is in it, and those processes would otherwise hold ports and cores forever.
    """
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and (everything or not _alive(int(match.group(1)))):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    address: str


class EmulatedNetwork:
    """Context manager: builds the namespaces and links on enter, removes them all on exit."""

    def __init__(self, endpoints: list[str], bandwidth: str, latency_ms: float = 0.0,
                 machines: dict[str, int] | None = None, intra_bandwidth: str | None = None) -> None:
        if len(endpoints) > MAX_ENDPOINTS:
            raise ValueError(f"an emulated network holds at most {MAX_ENDPOINTS} ranks and servers")
        parse_rate(bandwidth)  # a rate tc would misread is refused before anything is built
        self.bandwidth, self.latency_ms = bandwidth, latency_ms
        self.machines, self.intra_bandwidth = machines, intra_bandwidth
        self.prefix = f"tb{os.getpid()}n{next(_sequence)}"
        self.switch = f"{self.prefix}-sw"
        # Keys: r0, r1, ... for ranks; s0, s1, ... for parameter-server shards; LAUNCHER_ENDPOINT.
        self.endpoints = {e: Endpoint(f"{self.prefix}-{e}", f"{SUBNET}.{i + 2}") for i, e in enumerate(endpoints)}
        self._created: list[str] = []

    def __enter__(self) -> EmulatedNetwork:
        check_available()
        remove_leftovers()
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _link(self, inner: str, outer: str, name: str, peer: str, rate: str | None, bridged: bool = False) -> None:
        """A veth pair: ``name`` in namespace ``inner`` (a port of its br0 too where ``bridged``),
        ``peer`` a port of ``outer``'s br0, shaped at ``rate`` both ways (None: unshaped)."""
        _run("ip", "link", "add", name, "netns", inner, "type", "veth", "peer", "name", peer, "netns", outer)
        _run("ip", "-n", outer, "link", "set", peer, "master", "br0", "up")
        _run("ip", "-n", inner, "link", "set", name, *(["master", "br0"] if bridged else []), "up")
        if rate is not None:
            _run("tc", "-n", inner, "qdisc", "add", "dev", name, *shape(rate))
            _run("tc", "-n", outer, "qdisc", "add", "dev", peer, *shape(rate))

    def _add_bridge(self, namespace: str) -> None:
        self._add_namespace(namespace)
        _run("ip", "-n", namespace, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", namespace, "link", "set", "br0", "up")

    def machine_namespace(self, machine: int) -> str:
        return f"{self.prefix}-m{machine}"

    def _build(self) -> None:
        self._add_bridge(self.switch)
        if self.machines is not None:
            for machine in sorted(set(self.machines.values())):
                self._add_bridge(self.machine_namespace(machine))
                self._link(self.machine_namespace(machine), self.switch, UPLINK, f"m{machine}", self.bandwidth, bridged=True)
        for i, (key, ep) in enumerate(self.endpoints.items()):
            self._add_namespace(ep.namespace)
            if self.machines is None:
                self._link(ep.namespace, self.switch, INTERFACE, f"p{i}", self.bandwidth)
            else:
                self._link(ep.namespace, self.machine_namespace(self.machines[key]), INTERFACE, f"p{i}", self.intra_bandwidth)
            _run("ip", "-n", ep.namespace, "addr", "add", f"{ep.address}/24", "dev", INTERFACE)

    def traffic(self) -> dict[str, Any]:
        """``summary.json``'s ``topology``: the machine of each endpoint and what each machine's
        uplink carried over the whole run (initial broadcast and warm-up steps included)."""
        return {"machines": self.machines, "bandwidth": self.bandwidth, "intra_bandwidth": self.intra_bandwidth,
                "uplink_bytes": {str(m): b for m, b in self.uplink_bytes().items()}}

    def uplink_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each machine's uplink has carried so far, ``sent`` (to other machines) and
        ``received``, read off the kernel's counters of its ``uplink`` interface."""
        out = {}
        for machine in sorted(set((self.machines or {}).values())):
            proc = subprocess.run(["ip", "-n", self.machine_namespace(machine), "-s", "-j", "link", "show", UPLINK],
                                  capture_output=True, text=True, check=True)
            stats = json.loads(proc.stdout)[0]["stats64"]
            out[machine] = {"sent": int(stats["tx"]["bytes"]), "received": int(stats["rx"]["bytes"])}
        return out

    def remove(self) -> None:
        """Delete every namespace of this network; its veth pairs and bridge go with them."""
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()

    def rank_env(self, world_size: int) -> dict[str, str]:
        """Environment that tells spawned ranks where they live (read by ``enter_rank_namespace``)."""
        ports = {key: f"p{i}" for i, key in enumerate(self.endpoints)}  # as _build names them
        plan: dict[str, Any] = {
            # Each rank's namespace and address, and its link's far end: the bridge port that shapes
            # what the rank downloads (fault=link_slow re-shapes both ends).
            "ranks": [{"namespace": self.endpoints[f"r{r}"].namespace, "address": self.endpoints[f"r{r}"].address,
                       "port": ports[f"r{r}"], "bridge": self.switch if self.machines is None
                       else self.machine_namespace(self.machines[f"r{r}"])} for r in range(world_size)],
            "interface": INTERFACE,
            "latency_ms": self.latency_ms,
        }
        if self.machines is not None:  # the ranks see their machines as torchrun's would show them
            plan["machines"] = [self.machines[f"r{r}"] for r in range(world_size)]
        return {NETNS_ENV: json.dumps(plan)}
