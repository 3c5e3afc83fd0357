"""Hydra callback: after a multirun, the comparison table on the console and in the sweep dir."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.results.summary import read_summary
from testbed.results.table import COLUMNS, comparison_rows, format_table


def sweep_summaries(sweep_dir: Path) -> list[dict[str, Any]]:
    summaries = []
    for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        summary = read_summary(job_dir)
        if summary is not None:
            summary["job_dir"] = str(job_dir)
            summaries.append(summary)
    return summaries


def write_sweep_table(sweep_dir: Path) -> str:
    """Print-ready table of every job under ``sweep_dir``; also writes ``summary.csv`` there."""
    rows = comparison_rows(sweep_summaries(sweep_dir))
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for _, key in COLUMNS])
        writer.writeheader()
        writer.writerows({key: row.get(key) for _, key in COLUMNS} for row in rows)
    return format_table(rows)


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            print(f"\nComparison ({sweep_dir}):\n{write_sweep_table(sweep_dir)}", flush=True)
