"""``metrics/rank{r}.jsonl``: one JSON object per step, written in batches a fraction of a second apart."""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

from testbed.step_record import StepRecord


def metrics_path(job_dir: Path, rank: int) -> Path:
    return job_dir / "metrics" / f"rank{rank}.jsonl"


class StepLog:
    """Appends one line per record; writes and flushes at most every ``flush_s`` seconds and on close.

    A record is kept as it is and serialized with the others at the next flush: a JSON encode,
    write and flush per step cost tens of microseconds inside the step (most of the trainer's
    overhead over a plain loop on a millisecond step, measured); flushing on a timer moves that
    outside all but one step in hundreds. A rank killed outright loses the records since the last
    flush. (A writer thread was slower: it competes with the kernels' threads for the cores.)
    Records must not change after ``write``: a later flush would write the change.
    """

    def __init__(self, path: Path, flush_s: float = 0.25) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.flush_s = flush_s
        self._file = open(path, "w")
        self._pending: list[StepRecord] = []
        self._next_flush = time.monotonic() + flush_s
        _OPEN.add(self)

    def write(self, record: StepRecord) -> None:
        self._pending.append(record)
        if time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write("".join([json.dumps(r.to_json()) + "\n" for r in self._pending]))
            self._pending.clear()
        self._file.flush()
        self._next_flush = time.monotonic() + self.flush_s

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if not self._file.closed:
            self.flush()
            self._file.close()

    def rewrite(self, records: list[StepRecord]) -> None:
        """Replace the file atomically with completed records (e.g. t_wait filled in)."""
        self.close()
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r.to_json()) + "\n" for r in records)
        os.replace(tmp, self.path)


_OPEN: weakref.WeakSet[StepLog] = weakref.WeakSet()


def flush_open_logs() -> None:
    """Flush every open step log: for a process about to end without running its finally blocks."""
    for step_log in list(_OPEN):
        if not step_log._file.closed:
            step_log.flush()


def read_step_log(path: Path) -> list[dict[str, Any]]:
    """Records of one rank as the file has them (analysis, outside tools); a torn last line (the
    rank died mid-write) is skipped."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_step_records(path: Path) -> list[StepRecord]:
    """Records of one rank, typed: what the testbed itself reads back (a resumed or failed run)."""
    try:
        return [StepRecord.from_json(obj) for obj in read_step_log(path)]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
