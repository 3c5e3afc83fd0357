"""``metrics/rank{r}.jsonl``: one JSON object per step, written and flushed as each step ends."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Fields of every per-step record, in seconds and bytes (docs/results.md).
STEP_FIELDS = (
    "step", "rank", "samples", "loss",
    "t_data", "t_forward", "t_backward", "t_sync", "t_wait", "t_optimizer", "t_step",
    "bytes_sent", "bytes_recv", "t_sync_enter", "t_sync_exit",
)  # fmt: skip


def metrics_path(job_dir: Path, rank: int) -> Path:
    return job_dir / "metrics" / f"rank{rank}.jsonl"


class StepLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "w", buffering=1)  # line-buffered: a crash loses at most one line

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file atomically with completed records (e.g. t_wait filled in)."""
        self.close()
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(tmp, self.path)


def read_step_log(path: Path) -> list[dict[str, Any]]:
    """Records of one rank; a torn last line (the rank died mid-write) is skipped."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
