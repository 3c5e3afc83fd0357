"""Link latency, added in user space: the kernel has no netem, so senders sleep before each message.

The delay is one α per message at the sender, in series with the transfer (as in the α-β cost
model), not a propagation delay that pipelines with the data; native collectives (Gloo's own
all-reduce, DDP) do not see it, only the testbed's ring, tree, halving-doubling and parameter-server senders.
"""

from __future__ import annotations

import os
import time

LATENCY_ENV = "TESTBED_LINK_LATENCY_MS"

_latency_s = float(os.environ.get(LATENCY_ENV) or 0.0) / 1e3


def set_latency_ms(ms: float) -> None:
    global _latency_s
    _latency_s = ms / 1e3


def link_delay() -> None:
    """Sleep for the emulated link latency (nothing on real or loopback links)."""
    if _latency_s > 0.0:
        time.sleep(_latency_s)
