"""Emulated networks: every rank and parameter server in its own Linux network namespace, joined by
a bridge (or in two levels: machines of endpoints, one link per machine), each link rate-limited
in both directions with ``tc tbf``; latency added per message by the testbed's own senders (this
kernel has no netem; ``testbed.latency``). See ``links`` for the topology, ``rank`` for what a
process does to live in its namespace.
"""

from testbed.netem.links import (
    LAUNCHER_ENDPOINT,
    EmulatedNetwork,
    NetworkUnavailable,
    check_available,
    machines_of,
    parse_rate,
    remove_leftovers,
)
from testbed.netem.rank import enter_rank_namespace

__all__ = [
    "LAUNCHER_ENDPOINT",
    "EmulatedNetwork",
    "NetworkUnavailable",
    "check_available",
    "enter_rank_namespace",
    "machines_of",
    "parse_rate",
    "remove_leftovers",
]
