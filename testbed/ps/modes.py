"""What the parameter server's parts agree on: its modes and its defaults (no gRPC here).

- ``sync`` (BSP): a step's pushes are summed, applied once, and then every pull is released.
- ``async`` (ASP): each push is applied on arrival; pulls never wait.
- ``ssp``: applied on arrival, but a pull waits while its worker leads the slowest by more than
  ``staleness`` clocks.
"""

from __future__ import annotations

MODES = ("sync", "async", "ssp")
STALENESS = 2  # ssp's default bound
CHUNK_KB = 1024  # streamed chunk size
MAX_CHUNK_KB = 4096  # chunks stay under gRPC's message limit


def staleness_bound(mode: str, staleness: int) -> int | None:
    """Clocks a worker may lead the slowest one: 0 in sync mode, none in async."""
    return {"sync": 0, "ssp": staleness, "async": None}[mode]
