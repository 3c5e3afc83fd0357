"""``python -m testbed``: the Hydra app. One Hydra job = one distributed run (testbed.launch.job)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import hydra
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import DictConfig

from testbed.launch.existing import surrounding_world
from testbed.launch.rank_server import start_rank_server
from testbed.paths import config_dir

RANK_MODULE = "testbed.launch.rank"  # where rank_main lives: imported once, in the ranks' server


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    from testbed.launch.job import run_job

    return run_job(cfg)


def cli() -> None:
    """Entry point: check every job of the command line, then hand over to Hydra."""
    if surrounding_world() is None:
        # This launcher will spawn its ranks: their server imports torch while the launcher does.
        start_rank_server(RANK_MODULE)
    from testbed.config import ConfigError
    from testbed.launch.callbacks import SWEEP_JOBS_ENV
    from testbed.preflight import check_command_line

    try:
        os.environ[SWEEP_JOBS_ENV] = str(check_command_line(sys.argv[1:]))  # for the sweep's progress line
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    # Hydra's sweeper composes every job once more before it launches them, to find the errors the
    # check above has already ruled out: ~0.4 s of CPU per job.
    BasicSweeper.validate_batch_is_legal = lambda self, batch: None
    main()
    if surrounding_world() is not None:
        # A rank of a torchrun/Slurm world has written all its results. Interpreter finalization
        # can still abort in Gloo's worker threads ("terminate called without an active
        # exception", seen once in a dozen torchrun runs here), which would fail a finished run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    cli()
