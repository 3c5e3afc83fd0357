"""Slurm through Hydra's submitit launcher: one sweep point = one submitit job, its tasks the ranks.

The local executor (hydra/launcher=slurm_local) runs the same code path as Slurm on one machine;
the Slurm environment of a task is checked by setting the variables sbatch/srun would set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, read_json, read_jsonl, run_cli

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

TINY = ["steps=4", "warmup_steps=1"]
TORCH_ENV = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def job_dirs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/summary.json"))


def test_local_sweep_runs_one_world_per_point(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "hydra/launcher=slurm_local", "world_size=2", *TINY, "seed=0,1", f"hydra.sweep.dir={sweep}"],
                   tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_dirs(sweep)
    assert [p.name.split("_")[0] for p in jobs] == ["0", "1"]
    for job, seed in zip(jobs, (0, 1)):
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["replicas_identical"]
        assert f"seed={seed}" in summary["overrides"]
        assert len(read_jsonl(job / "metrics" / "rank1.jsonl")) == 4
        assert not (job / "logs").exists()  # nothing spawned by the testbed: the submitit tasks were the ranks
    tasks = sorted(p.name.split("_", 1)[1] for p in (sweep / ".submitit").glob("*/*_result.pkl"))
    assert tasks == ["0_result.pkl", "0_result.pkl", "1_result.pkl", "1_result.pkl"]  # two jobs of two tasks
    assert "Comparison" in proc.stdout  # the sweep ran to its end


def test_local_task_count_must_match_world_size(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=3", "world_size=2", *TINY,
                    f"hydra.sweep.dir={sweep}"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a bad point is recorded, as in any sweep
    (job,) = job_dirs(sweep)
    error = read_json(job / "summary.json")["error"]
    assert error["kind"] == "config"
    fix = "set hydra.launcher.tasks_per_node so that nodes x tasks_per_node = 2"
    assert f"world_size=2 but the surrounding torchrun/Slurm world has 3 ranks; {fix}" in error["message"]


def test_plain_world_still_refuses_multirun(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = run_cli(["-m", "world_size=2", *TINY, f"hydra.sweep.dir={sweep}"], tmp_path, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(sweep)
    assert "drop -m/--multirun" in read_json(job / "summary.json")["error"]["message"]


def slurm_task(procid: int, tmp_path: Path) -> dict:
    """What a task of a 2-node, 8-task submitit Slurm job learns from surrounding_world()."""
    env = {k: v for k, v in cli_env().items() if k not in TORCH_ENV and not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % 4),
                "SLURM_NODEID": str(procid // 4)})
    code = (
        "import json, os; from testbed.launch.existing import surrounding_world; "
        "print(json.dumps([surrounding_world(), os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layout, addr, port = json.loads(proc.stdout.splitlines()[-1])
    return {"layout": layout, "addr": addr, "port": port}


def test_slurm_task_rank_and_rendezvous_come_from_submitit(tmp_path: Path) -> None:
    first, sixth = slurm_task(0, tmp_path), slurm_task(5, tmp_path)
    assert first["layout"] == [0, 0, 8, 4] and sixth["layout"] == [5, 1, 8, 4]
    assert first["addr"] == sixth["addr"] == "gpu07"  # the job's first node hosts the rendezvous
    assert first["port"] == sixth["port"]  # drawn from the job id: the same for every task
