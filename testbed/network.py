"""The network group: loopback, or emulated links shaped with tc (testbed.netem).

How many ranks and servers a network must address depends on the synchronizer, so that check is
with the other groups' (testbed.config). The namespace code is imported only to check an emulated
network: declaring the group loads none of it (tests/test_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.checks import ConfigError, Option, options, require, resolved_backend


@dataclass
class LoopbackNetworkConfig:
    name: str = "loopback"


@dataclass
class EmulatedNetworkConfig:
    name: str = "emulated"
    bandwidth: str = "1gbit"  # per link and direction, in tc's units: bit, kbit, mbit, gbit
    # Added per message by the testbed's own senders (ring, tree, parameter server), not by the
    # backend's collectives: the kernel has no netem (testbed.latency).
    latency_ms: float = 0.0
    # Two levels: the ranks spread evenly over this many machines (contiguous ranks share one),
    # each machine's traffic to the others through one link at `bandwidth`; 0: flat, a link each.
    nodes: int = 0
    intra_bandwidth: str | None = None  # between the endpoints of one machine; null: unshaped
    servers: str = "separate"  # parameter-server shards on machines of their own, or `colocated` on the nodes


def check_rate(field: str, rate: str) -> None:
    """Refuse a link rate that tc would not read as written, naming ``field``."""
    from testbed.netem.links import parse_rate

    try:
        parse_rate(rate)
    except ValueError as exc:
        raise ConfigError(f"{field}={rate}: {exc}") from None


def _check_emulated(cfg: Any) -> None:
    from testbed.netem.links import PLACEMENTS, NetworkUnavailable, check_available

    net = cfg.network
    check_rate("network.bandwidth", net.bandwidth)
    require(net.latency_ms >= 0, f"network.latency_ms={net.latency_ms}: must be >= 0")
    nodes, n = int(net.nodes), int(cfg.world_size)
    require(nodes >= 0 and (nodes == 0 or n % nodes == 0),
            f"network.nodes={nodes}: the ranks spread evenly over the machines: a divisor of world_size={n} (0: flat)")
    if net.intra_bandwidth is not None:
        check_rate("network.intra_bandwidth", net.intra_bandwidth)
    require(net.servers in PLACEMENTS,
            f"network.servers={net.servers}: one of {'|'.join(PLACEMENTS)} (shards on machines of their own, or on the nodes)")
    require(resolved_backend(cfg) == "gloo", "network=emulated shapes TCP links between hosts: use backend=gloo (device=cpu)")
    try:
        check_available()
    except NetworkUnavailable as exc:
        raise ConfigError(str(exc)) from None


NETWORKS = options(
    Option("loopback", LoopbackNetworkConfig),
    Option("emulated", EmulatedNetworkConfig, _check_emulated),
)
