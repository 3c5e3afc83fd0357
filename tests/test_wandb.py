"""W&B mirroring: an offline run holds the job's group, job type, config, history and summary, read
back from its .wandb file without network; an unreachable W&B never stops training."""

from __future__ import annotations

from pathlib import Path

from conftest import read_json, read_jsonl, run_cli

from analysis.load import read_offline_run


def test_offline_run_mirrors_the_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "sync=ring", "world_size=2", "steps=6", "warmup_steps=1", "wandb.mode=offline",
                    f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={"WANDB_MODE": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = [p.parent for p in sweep.glob("*/summary.json")]
    (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")  # one W&B run per job, inside the job dir
    run = read_offline_run(run_file)
    assert run["run"]["group"] == str(sweep) and run["run"]["job_type"] == "ring"
    assert "sync=ring" in run["run"]["name"] and "world_size=2" in run["run"]["name"]
    assert run["config"]["sync"]["name"] == "ring" and run["config"]["world_size"] == 2
    assert "sync=ring" in run["config"]["overrides"]
    records = read_jsonl(job / "metrics" / "rank0.jsonl")
    assert [h["step"] for h in run["history"]] == [r["step"] for r in records]
    assert [h["loss"] for h in run["history"]] == [r["loss"] for r in records]
    summary = read_json(job / "summary.json")
    assert run["summary"]["throughput"] == summary["throughput"]
    assert run["summary"]["status"] == "ok"
    assert run["summary"]["phases/t_sync"] == summary["phases"]["t_sync"]["median"]


def test_an_unreachable_wandb_never_stops_training(tmp_path: Path) -> None:
    job = tmp_path / "job"
    args = ["wandb.mode=online", "wandb.init_timeout_s=10", "steps=6", "warmup_steps=1", f"hydra.run.dir={job}"]
    # No API key, and a server address where nothing listens: W&B cannot start.
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "WANDB_BASE_URL": "http://127.0.0.1:9", "HOME": str(tmp_path)}
    proc = run_cli(args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(job / "summary.json")["status"] == "ok"
    logs = "".join(p.read_text() for p in job.glob("logs/*/attempt_0/0/*.log"))
    assert logs.count("W&B start failed, continuing without it") == 1
