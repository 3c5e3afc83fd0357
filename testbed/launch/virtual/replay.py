"""A real parameter-server run's order of events, read back from its step logs, for a virtual run to replay.

With one shard, asynchronous and bounded-staleness pushes are applied one at a time, each making
the next version: the push of a gradient computed on version ``version`` with staleness
``staleness`` was applied ``version + staleness``-th, and a worker's pull after a step streamed the
version its next step's gradient was computed on. That is the whole order the math depends on, so
replaying it in a virtual run (``launcher.replay``) computes the real run's model.
"""

from __future__ import annotations

from pathlib import Path

from testbed.results.step_log import metrics_path, read_step_records
from testbed.sim.events import PULL, PUSH


def replayed_order(job_dir: Path, workers: int, steps: int) -> list[tuple[int, int, int]]:
    """(PUSH or PULL, worker, step) in the order the real run's shard took them; ValueError naming
    what the step logs lack."""
    placed: dict[int, tuple[int, int]] = {}  # place in the server's order -> (worker, step) pushed there
    pulls: dict[int, list[tuple[int, int]]] = {}  # version -> (worker, step) whose pull streamed it
    for worker in range(workers):
        records = read_step_records(metrics_path(job_dir, worker))
        if [r.step for r in records] != list(range(steps)):
            raise ValueError(f"{job_dir}: rank {worker} logged steps {records[0].step if records else '-'}.."
                             f"{records[-1].step if records else '-'} of a run of {steps}; replay a complete run")
        if any(r.version is None or r.staleness is None for r in records):
            raise ValueError(f"{job_dir}: rank {worker}'s step log has no pushed versions; replay a parameter-server "
                             "run made by this version of the testbed")
        for record in records:
            place = record.version + record.staleness
            if place in placed:
                raise ValueError(f"{job_dir}: two pushes at place {place} of the server's order: its step logs come "
                                 "from more than one shard's order (replay a run of sync.servers=1)")
            placed[place] = (worker, record.step)
        for before, after in zip(records, records[1:]):
            pulls.setdefault(after.version, []).append((worker, before.step))
    if sorted(placed) != list(range(len(placed))):
        raise ValueError(f"{job_dir}: the pushes' places leave gaps in the server's order; not one shard's run")
    order = []
    for place in range(len(placed)):
        order.append((PUSH, *placed[place]))
        order.extend((PULL, worker, step) for worker, step in pulls.get(place + 1, []))
    return order
