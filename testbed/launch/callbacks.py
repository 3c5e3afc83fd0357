"""Hydra callback: after a multirun, the comparison table on the console and in the sweep dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.results.summary import load_summaries
from testbed.results.table import comparison_rows, format_table, write_csv


def write_sweep_table(sweep_dir: Path) -> str:
    """Print-ready table of every job under ``sweep_dir``; also writes ``summary.csv`` there."""
    rows = comparison_rows(load_summaries([sweep_dir]))
    write_csv(rows, sweep_dir / "summary.csv")
    return format_table(rows)


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            print(f"\nComparison ({sweep_dir}):\n{write_sweep_table(sweep_dir)}", flush=True)
