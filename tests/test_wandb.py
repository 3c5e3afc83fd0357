"""W&B mirroring: an offline run holds the job's group, job type, config, history and summary, read
back from its .wandb file without network; the sweep's analysis run holds its tables, figures and
report; the workspace's panels name only keys the runs hold; an unreachable W&B never stops training."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from conftest import read_json, read_jsonl, run_cli

from analysis import workspace
from analysis.dashboard import job_updates
from analysis.load import load, read_offline_run


@pytest.mark.serial  # a sweep and its analysis: kept off the parallel tier, whose fault tests keep 10 s deadlines
def test_offline_runs_mirror_the_jobs_and_the_sweeps_analysis_joins_them(tmp_path: Path) -> None:
    sweep, scratch = tmp_path / "sweep", tmp_path / "scratch"
    scratch.mkdir()
    proc = run_cli(["-m", "sync=ring", "world_size=1,2", "steps=6", "warmup_steps=1", "wandb.mode=offline",
                    f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={"WANDB_MODE": None, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # W&B's temporary directories removed too (ranks end without the interpreter's exit); torch's
    # compile cache is a cache, kept on purpose.
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    group = f"{tmp_path.name}/sweep"  # readable: the sweep directory's last two components
    jobs = {read_json(p)["world_size"]: p.parent for p in sweep.glob("*/summary.json")}
    job = jobs[2]
    (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")  # one W&B run per job, inside the job dir
    run = read_offline_run(run_file)
    summary = read_json(job / "summary.json")
    assert run["run"]["group"] == group == summary["wandb_group"] and run["run"]["job_type"] == "ring"
    assert "sync=ring" in run["run"]["name"] and "world_size=2" in run["run"]["name"]
    assert run["config"]["sync"]["name"] == "ring" and run["config"]["world_size"] == 2
    assert "sync=ring" in run["config"]["overrides"]
    records = read_jsonl(job / "metrics" / "rank0.jsonl")
    history = [h for h in run["history"] if "loss" in h]  # the step records; evaluations are rows of their own
    assert [h["step"] for h in history] == [r["step"] for r in records]
    assert [h["loss"] for h in history] == [r["loss"] for r in records]
    assert [h["wall_s"] for h in history] == pytest.approx(list(itertools.accumulate(r["t_step"] for r in records)))
    (evaluated,) = [h for h in run["history"] if "eval/step" in h]  # the final model's, held out
    assert evaluated["eval/accuracy"] == summary["eval"]["final"]["accuracy"] and evaluated["eval/step"] == 5
    assert run["summary"]["throughput"] == summary["throughput"]
    assert run["summary"]["status"] == "ok"
    assert run["summary"]["phases/t_sync"] == summary["phases"]["t_sync"]["median"]

    # The sweep's analysis run, logged at its end, in the same group: tables, figures, the report.
    (analysis_file,) = sweep.glob("analysis/wandb/offline-run-*/run-*.wandb")
    analysis = read_offline_run(analysis_file)
    assert analysis["run"]["group"] == group and analysis["run"]["job_type"] == "analysis"
    logged = {k: v for row in analysis["history"] for k, v in row.items()}
    files = analysis_file.parent / "files"

    def table(name: str) -> list[dict]:
        data = json.loads((files / logged[f"table/{name}/path"]).read_text())  # nested keys come flattened
        return [dict(zip(data["columns"], row)) for row in data["data"]]

    scaling = {row["world_size"]: row for row in table("scaling")}
    assert set(scaling) == {1, 2} and scaling[1]["efficiency"] == pytest.approx(1.0)
    assert scaling[2]["throughput"] == pytest.approx(summary["throughput"])
    assert {"option", "speedup", "efficiency_common", "marginal_speedup"} <= set(scaling[2])
    assert {"t_forward", "t_backward", "t_transfer"} <= set(table("breakdown")[0])
    assert {row["world_size"] for row in table("time_to_target")} == {1, 2}
    waits = [r["t_wait"] for r in table("steps") if r["world_size"] == 2 and r["rank"] == 1]
    assert waits == pytest.approx([r["t_wait"] for r in read_jsonl(job / "metrics" / "rank1.jsonl")])  # known only after the run
    figures = {p.stem for p in (sweep / "analysis").glob("*.png")}
    assert figures and {k.split("/")[1] for k in logged if k.startswith("figure/")} == figures
    assert all(logged[f"figure/{f}/_type"] == "image-file" for f in figures)
    (report,) = [a for a in analysis["artifacts"] if a["type"] == "report"]
    assert report["type"] == "report" and {"report.md", "summary.csv"} <= set(report["files"])

    # Every key the saved workspace's panels name is one the runs hold (efficiency and speed-up: the
    # values the analysis writes into the job runs' summaries online, computed here the same way).
    updates = job_updates(load([str(sweep)])[0])[",".join(summary["overrides"])]
    assert updates["efficiency"] == pytest.approx(scaling[2]["efficiency"])
    keys = workspace.referenced(workspace.build("entity", "project", group))
    assert keys["config"] <= set(run["config"]) and keys["history"] <= {k for row in run["history"] for k in row}
    assert keys["summary"] <= set(run["summary"]) | set(updates), keys["summary"] - set(run["summary"]) - set(updates)


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
