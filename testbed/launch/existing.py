"""Detecting a world that someone else started (torchrun, Slurm, submitit), which the job then joins."""

from __future__ import annotations

import os


def surrounding_world() -> tuple[int, int, int, int] | None:
    """(rank, local_rank, world_size, local_world_size) when launched inside a world, else None.

    torchrun sets TORCHELASTIC_RUN_ID (and RANK, WORLD_SIZE); Slurm sets SLURM_PROCID and
    SLURM_NTASKS; a submitit job (Hydra's submitit launcher) sets SUBMITIT_EXECUTOR, and its tasks
    learn their rank and rendezvous from submitit. A single task (an interactive allocation, a
    submitit job with one task) is not a world: the job spawns its own.
    """
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        return _layout()
    if in_submitit_job():
        from submitit.helpers import TorchDistributedEnvironment

        # MASTER_ADDR: the job's first host; MASTER_PORT: one drawn from the job id, the same for
        # every task (or MASTER_PORT if set). CUDA_VISIBLE_DEVICES is left alone: ranks pick
        # cuda:LOCAL_RANK themselves.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return _layout()
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            from testbed.checks import ConfigError

            raise ConfigError(
                "running as a Slurm task: set MASTER_ADDR and MASTER_PORT (e.g. the first host of "
                "SLURM_JOB_NODELIST and a free port) so that the tasks can meet"
            )
        return _layout()
    return None


def _layout() -> tuple[int, int, int, int]:
    # Imported here: outside a world (the common case) this module loads nothing heavy, so that the
    # launcher can ask before it imports torch.
    from testbed.world import env_rank_layout

    return env_rank_layout()


def in_submitit_job() -> bool:
    """True in a task of a submitit job with more than one task: one task is one rank."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return False
    from submitit import JobEnvironment  # an optional extra, present in every submitit job

    return JobEnvironment().num_tasks > 1
