"""Detecting a world that someone else started (torchrun, Slurm), which the job then joins."""

from __future__ import annotations

import os
from typing import Optional

from testbed.config import ConfigError
from testbed.world import env_rank_layout


def surrounding_world() -> Optional[tuple[int, int, int, int]]:
    """(rank, local_rank, world_size, local_world_size) when launched inside a world, else None.

    torchrun sets TORCHELASTIC_RUN_ID (and RANK, WORLD_SIZE); Slurm sets SLURM_PROCID and
    SLURM_NTASKS. A single Slurm task (an interactive allocation) is not a world: the job spawns its own.
    """
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        return env_rank_layout()
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ConfigError(
                "running as a Slurm task: set MASTER_ADDR and MASTER_PORT (e.g. the first host of "
                "SLURM_JOB_NODELIST and a free port) so that the tasks can meet"
            )
        return env_rank_layout()
    return None
