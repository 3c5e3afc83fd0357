"""A sweep stopped mid-way and run again with ``sweep_resume=true`` goes on from where it stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import assert_nothing_left, cli_env, read_json, run_cli

# Six jobs of a few seconds each, checkpointing; the parameter server's ports change from run to
# run, its result's identity must not.
SWEEP = ["-m", "sync=allreduce,ps", "seed=0,1,2", "world_size=2", "steps=60", "warmup_steps=1", "checkpoint.every=10",
         "launcher.echo_rank0=false", "device=cpu"]


def job_files(job: Path) -> dict[str, tuple[int, bytes]]:
    """What a run wrote (Hydra's own .hydra copies and log aside): path -> (mtime, content)."""
    return {str(p.relative_to(job)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(job.rglob("*"))
            if p.is_file() and ".hydra" not in p.parts and p.name != "testbed.log"}


def test_a_stopped_sweep_resumes_without_rerunning_what_is_done(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "testbed", *SWEEP, f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list(sweep.glob("3_*/checkpoints/step*/manifest.json")):
        time.sleep(0.05)
    assert list(sweep.glob("3_*/checkpoints/step*/manifest.json")), "the 4th job never checkpointed"
    proc.send_signal(signal.SIGTERM)  # to the Hydra process, during the 4th job, after its first checkpoint
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    jobs = sorted(sweep.glob("[0-9]_*"), key=lambda d: int(d.name.split("_")[0]))
    assert len(jobs) == 4, output[-3000:]  # the sweep ended with the stopped job
    stopped = read_json(jobs[3] / "summary.json")
    assert stopped["status"] == "failed" and stopped["error"]["kind"] == "stopped", stopped["error"]
    assert stopped["error"]["message"] == "stopped by SIGTERM" and 10 <= stopped["error"]["step"] < 60
    assert_nothing_left(jobs[3])
    done = {job.name: job_files(job) for job in jobs[:3]}
    assert all(read_json(job / "summary.json")["status"] == "ok" for job in jobs[:3])

    resumed = run_cli([*SWEEP, f"hydra.sweep.dir={sweep}", "sweep_resume=true"], cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    jobs = sorted(sweep.glob("[0-9]_*"), key=lambda d: int(d.name.split("_")[0]))
    assert len(jobs) == 6  # the same directories: sweep_resume is not part of their names
    assert {job.name: job_files(job) for job in jobs[:3]} == done  # not rerun, not touched
    assert resumed.stdout.count("is ok with this config (sweep_resume)") == 3
    summaries = [read_json(job / "summary.json") for job in jobs]
    assert [s["status"] for s in summaries] == ["ok"] * 6 and all(s["steps"] == 60 for s in summaries)
    assert len({s["config_hash"] for s in summaries}) == 6
    # The stopped job went on from its checkpoint; its first attempt is kept beside, not a job of its own.
    earlier = jobs[3] / "attempts" / "0"
    assert summaries[3]["config"]["resume"] == str(earlier)
    assert read_json(earlier / "summary.json")["error"]["kind"] == "stopped"
    assert [s["status"] for s in summaries[4:]] == ["ok", "ok"] and not (jobs[4] / "attempts").exists()
    # The end-of-sweep table lists every job, the three done before as well.
    table = resumed.stdout.split("Comparison (", 1)[1]
    assert sum(line.split()[0] in ("allreduce", "ps-sync") for line in table.splitlines()[3:] if line.strip()) == 6
