"""The emulated network of one run: a namespace per endpoint (rank or server), a bridge, shaped links.

Topology: namespace ``<prefix>-sw`` holds bridge ``br0``; each endpoint ``e`` gets namespace
``<prefix>-<e>`` with interface ``eth0`` (address ``10.78.0.x/24``) whose veth peer is a port of the
bridge. ``tc tbf`` shapes both directions of every link: egress of ``eth0`` (the endpoint's
upload) and egress of the bridge port (its download). Nothing touches the root namespace.

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
MAX_ENDPOINTS = 250
# Each shaped port queues up to this much of its line rate (tbf's latency). At 5 ms (62 KB at
# 100 Mbit) the pushes of two workers converging on one server overflowed it, and the lost packets
# stalled for TCP's 200 ms minimum retransmission timeout: the sharded PS measured half its bound.
QUEUE = "20ms"
_NAME = re.compile(r"^tb(\d+)n\d+-")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_sequence = itertools.count()


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

    def __init__(self, endpoints: list[str], bandwidth: str, latency_ms: float = 0.0) -> None:
        if len(endpoints) > MAX_ENDPOINTS:
            raise ValueError(f"an emulated network holds at most {MAX_ENDPOINTS} ranks and servers")
        self.rate_bps = parse_rate(bandwidth)
        self.bandwidth, self.latency_ms = bandwidth, latency_ms
        self.prefix = f"tb{os.getpid()}n{next(_sequence)}"
        self.switch = f"{self.prefix}-sw"
        # Keys: r0, r1, ... for ranks; s0, s1, ... for parameter-server shards.
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

    def _build(self) -> None:
        # tbf needs a bucket of at least one timer tick of traffic; 2 ms of line rate, >= 64 KiB.
        burst = str(max(64 * 1024, int(self.rate_bps / 8 / 500)))
        shape = ["root", "tbf", "rate", self.bandwidth, "burst", burst, "latency", QUEUE]
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ep in enumerate(self.endpoints.values()):
            port = f"p{i}"
            self._add_namespace(ep.namespace)
            _run("ip", "link", "add", INTERFACE, "netns", ep.namespace, "type", "veth", "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ep.namespace, "addr", "add", f"{ep.address}/24", "dev", INTERFACE)
            _run("ip", "-n", ep.namespace, "link", "set", INTERFACE, "up")
            _run("tc", "-n", ep.namespace, "qdisc", "add", "dev", INTERFACE, *shape)
            _run("tc", "-n", self.switch, "qdisc", "add", "dev", port, *shape)

    def remove(self) -> None:
        """Delete every namespace of this network; its veth pairs and bridge go with them."""
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()

    def rank_env(self, world_size: int) -> dict[str, str]:
        """Environment that tells spawned ranks where they live (read by ``enter_rank_namespace``)."""
        ranks = [self.endpoints[f"r{r}"] for r in range(world_size)]
        plan: dict[str, Any] = {
            "ranks": [{"namespace": ep.namespace, "address": ep.address} for ep in ranks],
            "interface": INTERFACE,
            "latency_ms": self.latency_ms,
        }
        return {NETNS_ENV: json.dumps(plan)}
