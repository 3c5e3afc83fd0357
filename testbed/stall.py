"""Who did not arrive: the stall check of a synchronous step (as Horovod's stall check does).

A collective that times out only says that this rank waited. Every rank therefore posts the step
at which it last entered synchronization, and a heartbeat every second, to the process group's
store from a background thread (off the step's critical path); when a synchronization fails, the
rank reads everyone's posts and names the ranks that never came, or went silent (a rank whose link
is down can arrive at a step and still never deliver its part). Rank 0 also warns while a step is
stalled, long before the timeout ends the run.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from testbed.rank_failure import RunFailure

log = logging.getLogger("testbed")
KEY = "testbed/arrived/{}"  # "<step>:<wall time>" of the rank's last arrival or heartbeat
HEARTBEAT_S = 1.0
POST_EVERY_S = 0.1  # at most ten posts a second, however short the steps
# A synchronization that failed sooner than this was not a stall (a peer's crash, a refused call),
# and the posts of ranks that did arrive may still be on their way.
STALL_AFTER_S = 2.0
SILENT_S = 5.0  # a rank whose heartbeat is older than this is named with those that did not arrive


class StallError(RunFailure, RuntimeError):
    """A synchronization failed while some ranks had not arrived at it."""

    kind = "stall"

    def __init__(self, step: int, missing: list[int], arrived: dict[int, int], cause: BaseException) -> None:
        self.step, self.missing, self.arrived = step, missing, arrived
        last = ", ".join(f"rank {r} at step {arrived.get(r, -1)}" for r in missing)
        super().__init__(f"step {step}: rank(s) {missing} did not arrive or went silent (last arrived: {last}); {cause}")

    def facts(self) -> dict[str, Any]:
        return {"missing": self.missing}


class Arrivals:
    """This rank's arrivals, posted to the store; everyone's, read back when a step fails."""

    def __init__(self, rank: int, world_size: int, warn_after_s: float, store: dist.Store) -> None:
        self.rank, self.world_size, self.warn_after_s, self.store = rank, world_size, warn_after_s, store
        self._arrived, self._posted = -1, -1
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._post_loop, name="testbed-arrivals", daemon=True)
        self._thread.start()

    def arrive(self, step: int) -> None:
        with self._wake:
            self._arrived = step
            self._wake.notify()

    def stall(self, step: int, waited_s: float, cause: BaseException) -> StallError | None:
        """The stall behind a synchronization that failed after ``waited_s``, if it was one."""
        if waited_s < STALL_AFTER_S:
            return None
        missing, arrived = self.missing(step)
        return StallError(step, missing, arrived, cause) if missing else None

    def missing(self, step: int) -> tuple[list[int], dict[int, int]]:
        """(ranks whose last arrival is before ``step`` or whose heartbeat is stale, every rank's
        last arrival)."""
        posts = self._read_all()
        now = time.time()
        missing = [r for r in range(self.world_size)
                   if r not in posts or posts[r][0] < step or now - posts[r][1] > SILENT_S]
        return missing, {r: arrived for r, (arrived, _) in posts.items()}

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=1.0)

    def _read_all(self) -> dict[int, tuple[int, float]]:
        """{rank: (last arrival, wall time of its last post)} of the ranks that have posted."""
        keys = [KEY.format(r) for r in range(self.world_size)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        posts = {}
        for key, value in zip(present, values):
            step, stamp = value.decode().split(":")
            posts[keys.index(key)] = (int(step), float(stamp))
        return posts

    def _post_loop(self) -> None:
        stalled_since: dict[int, float] = {}
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stop or self._arrived != self._posted, timeout=HEARTBEAT_S)
                if self._stop:
                    return
                arrived = self._arrived
            try:
                self.store.set(KEY.format(self.rank), f"{arrived}:{time.time()}")
                self._posted = arrived
                if self.rank == 0:
                    self._warn_stalled(stalled_since)
            except Exception:  # the store is gone (the run is ending) or unreachable: nothing to post
                return
            with self._wake:
                self._wake.wait_for(lambda: self._stop, timeout=POST_EVERY_S)

    def _warn_stalled(self, since: dict[int, float]) -> None:
        posts = self._read_all()
        arrived = {r: step for r, (step, _) in posts.items()}
        front = max(arrived.values(), default=-1)
        now, wall = time.monotonic(), time.time()
        behind = [r for r in range(self.world_size)
                  if arrived.get(r, -1) < front or r in posts and wall - posts[r][1] > SILENT_S]
        for r in list(since):
            if r not in behind:
                del since[r]
        for r in behind:
            started = since.setdefault(r, now)
            if now - started >= self.warn_after_s:
                log.warning("stall: rank %d has not arrived at step %d, or is silent, for %.0f s (last at step %d)",
                            r, front, now - started, arrived.get(r, -1))
                since[r] = now  # once per interval, not every check
