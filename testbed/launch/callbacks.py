"""Hydra callback of a multirun: a progress line as each job starts; at the end, the comparison
table on the console and in the sweep dir, and, when the jobs log to W&B, the sweep's analysis
run beside them (analysis.dashboard)."""

from __future__ import annotations

import logging
import os
import time
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


log = logging.getLogger("testbed")
SWEEP_JOBS_ENV = "TESTBED_SWEEP_JOBS"  # jobs in the sweep, counted by the preflight check


class SweepTable(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        started = getattr(self, "started", None)
        if started is None:  # a single run: no sweep to report on
            return
        done, total = int(config.hydra.job.num), int(os.environ.get(SWEEP_JOBS_ENV) or 0)
        elapsed = time.monotonic() - started
        eta = f", eta {elapsed / done * (total - done):.0f}s" if done and total else ""
        of = f"/{total}" if total else ""
        print(f"[sweep {done + 1}{of}] {config.hydra.job.override_dirname}  (elapsed {elapsed:.0f}s{eta})", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        print(f"\nComparison ({sweep_dir}):\n{write_sweep_table(sweep_dir)}", flush=True)
        if config.wandb.mode != "disabled":  # the jobs are W&B runs: their comparison joins them
            from analysis.__main__ import main as analyse

            try:
                analyse([str(sweep_dir), "--wandb", "--wandb-mode", str(config.wandb.mode)])
            except Exception as exc:  # W&B is a mirror: the sweep's results are written already
                log.warning("the sweep's W&B analysis failed: %s: %s", type(exc).__name__, exc)
