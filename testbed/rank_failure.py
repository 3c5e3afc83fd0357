"""What a failing rank says about its own failure, before its connections close.

The launch agent reports the first rank whose process it finds dead, and that is often not the
cause: a rank that raised closes its sockets on the way out, and a peer blocked in a collective
with it fails at once with "connection reset by peer", sometimes exiting first. So each rank
records its exception with a wall-clock time before it tears anything down, and the launcher
blames the earliest failure that is not a lost peer's report. A rank killed by a signal records
nothing; a rank that lost a peer therefore waits a moment before it exits, so that the agent finds
the killed one first.

A record carries the failure's ``kind`` (docs/results.md, ``error.kind``), taken from the
exception's class: the testbed's own failures derive from ``RunFailure`` and name theirs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

# How Gloo and sockets report a peer that went away: a consequence, never a cause.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe")
LOST_PEER_GRACE_S = 1.5  # the agent polls every 0.1 s


class RunFailure(Exception):
    """A failure the testbed raises itself: ``kind`` is what the run's summary records it as, and
    ``facts()`` what it adds to the summary's error."""

    kind: ClassVar[str] = "error"

    def facts(self) -> dict[str, Any]:
        return {}


def kind_of(exc: BaseException) -> str:
    """The summary's ``error.kind`` for an exception a rank raised."""
    if isinstance(exc, RunFailure):
        return exc.kind
    # Gloo's and the c10d store's timeouts are plain RuntimeErrors: their wording is all they carry.
    if isinstance(exc, TimeoutError) or any(word in str(exc).lower() for word in ("timed out", "timeout")):
        return "timeout"
    return "error"


def lost_peer(message: str) -> bool:
    lowered = message.lower()
    return any(text in lowered for text in _LOST_PEER)


def record_failure(log_dir: Path, rank: int, exc: BaseException) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = {"rank": rank, "time": time.time(), "message": f"{type(exc).__name__}: {exc}", "kind": kind_of(exc),
             "facts": exc.facts() if isinstance(exc, RunFailure) else {}}
    (log_dir / f"failure-rank{rank}.json").write_text(json.dumps(facts))


def recorded(log_dir: Path, rank: int) -> dict[str, Any] | None:
    """The failure ``rank`` recorded (none for a rank killed by a signal)."""
    path = log_dir / f"failure-rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def root_cause(log_dir: Path) -> dict[str, Any] | None:
    """The earliest recorded failure that is not a lost peer's report: ``rank``, ``time``, ``message``,
    ``kind``, ``facts``."""
    failures = [json.loads(p.read_text()) for p in sorted(log_dir.glob("failure-rank*.json"))]
    causes = [f for f in failures if not lost_peer(f["message"])]
    return min(causes, key=lambda f: (f["time"], f["rank"])) if causes else None
