"""``python -m testbed.sim``: predict a run (or a sweep, with -m) instead of running it.

Takes the same config groups and overrides as ``python -m testbed`` plus the ``sim`` node (how the
links and compute are known), and writes the same ``summary.json`` per job, marked
``"simulated": true``, so analysis draws predicted and measured points alike. ``world_size`` may
be far beyond one machine.

  python -m testbed.sim -m sync=ring,ps world_size=1,8,64,512 sim.calibration=cal.json sim.compute_from=<job dir>
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed import config
from testbed.paths import config_dir
from testbed.results.summary import write_summary
from testbed.results.table import format_table, summary_row
from testbed.sim.step import simulate
from testbed.sweeps import excluded


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    hydra_cfg = HydraConfig.get()
    if excluded(hydra_cfg.overrides.task, cfg.get("sweep_exclude")) is not None:
        return None
    try:
        summary = simulate(cfg)
    except config.ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    summary["overrides"] = list(hydra_cfg.overrides.task)
    write_summary(Path(hydra_cfg.runtime.output_dir), summary)
    print(format_table([summary_row(summary)]), flush=True)
    return summary


if __name__ == "__main__":
    main()
