"""The gRPC parameter server through the trainer: equivalence, convergence, sizes, cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, load_params, rank_pids, read_json, read_jsonl, run_cli, wait_for_steps
from test_equivalence import COMMON, TOL, relative_error


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once it is not running.
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def server_pids(job: Path) -> list[int]:
    return [int(m) for log in sorted((job / "logs").glob("ps*.log")) for m in re.findall(r"pid (\d+)", log.read_text())]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ps")
    out = {"single": root / "single", "allreduce": root / "allreduce", "ps": root / "ps"}
    for args, key in ((["sync=none", "world_size=1"], "single"), (["sync=allreduce", "world_size=2"], "allreduce")):
        proc = run_cli([*args, *COMMON, f"hydra.run.dir={out[key]}"], cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(["-m", "sync=ps", "sync.mode=sync", "sync.servers=1,2", "world_size=2,3,4", *COMMON,
                    f"hydra.sweep.dir={out['ps']}"], cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_sync_ps_equals_allreduce_and_single_process(references: dict[str, Path]) -> None:
    single, allreduce = load_params(references["single"]), load_params(references["allreduce"])
    jobs = [d for d in references["ps"].iterdir() if (d / "summary.json").exists()]
    assert len(jobs) == 6  # k = 1, 2 servers x n = 2, 3, 4 workers
    for job in jobs:
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok" and summary["replicas_identical"], job.name
        assert summary["staleness_histogram"] == [summary["world_size"] * summary["steps"]]  # BSP: all fresh
        params = load_params(job)
        assert relative_error(params, single) <= TOL, job.name
        assert relative_error(params, allreduce) <= TOL, job.name


def test_ps_records_its_own_wait_and_traffic(references: dict[str, Path]) -> None:
    job = next(d for d in references["ps"].iterdir() if (d / "summary.json").exists())
    summary = read_json(job / "summary.json")
    for rank in range(summary["world_size"]):
        for r in read_jsonl(job / "metrics" / f"rank{rank}.jsonl"):
            assert 0.0 <= r["t_wait"] <= r["t_sync"] and r["staleness"] == 0
            assert r["bytes_sent"] == r["bytes_recv"] == summary["gradient_bytes"]
    facts = summary["sync_facts"]
    assert facts["mode"] == "sync" and all(s["rejected"] == 0 for s in facts["server_stats"])


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Async and SSP at 2 and 4 workers, one sweep: each mode's jobs."""
    sweep = tmp_path_factory.mktemp("digits")
    proc = run_cli(["-m", "sync=ps", "sync.mode=async,ssp", "sync.staleness=2", "world_size=2,4", "data=digits",
                    "model.hidden=64", "optim.lr=0.1", "steps=120", "launcher.echo_rank0=false",
                    f"hydra.sweep.dir={sweep}"], cwd=sweep, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs: dict[str, list[Path]] = {}
    for path in sweep.glob("*/summary.json"):
        jobs.setdefault(read_json(path)["config"]["sync"]["mode"], []).append(path.parent)
    return jobs


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_train_digits(digits: dict[str, list[Path]], mode: str) -> None:
    assert sorted(read_json(job / "summary.json")["world_size"] for job in digits[mode]) == [2, 4]
    for job in digits[mode]:
        s = read_json(job / "summary.json")
        # One batch of 32 is a noisy witness and async's staleness depends on scheduling: judge learning by
        # every rank's losses over the last 20 steps, against chance (ln 10 = 2.30).
        late = [r["loss"] for rank in range(s["world_size"]) for r in read_jsonl(job / "metrics" / f"rank{rank}.jsonl")
                if r["step"] >= s["steps"] - 20]
        late_mean = sum(late) / len(late)
        assert s["status"] == "ok" and s["loss_first"] > 2.0 and late_mean < 1.0, (s["world_size"], late_mean)
        assert s["replicas_identical"]  # every worker pulled the servers' final model
        assert sum(s["staleness_histogram"]) == s["world_size"] * s["steps"]


def test_model_larger_than_grpc_default_message_limit(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = run_cli(["sync=ps", "sync.servers=2", "world_size=2", "model.hidden=1024", "steps=4", "warmup_steps=1",
                    f"hydra.run.dir={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["gradient_bytes"] > 4 * 2**20


def test_servers_and_ranks_are_gone_after_a_run(references: dict[str, Path]) -> None:
    for job in [d for d in references["ps"].iterdir() if (d / "summary.json").exists()]:
        pids = server_pids(job) + rank_pids(job)
        assert len(server_pids(job)) == read_json(job / "summary.json")["config"]["sync"]["servers"]
        assert pids and not [p for p in pids if alive(p)], job.name


def test_servers_and_ranks_are_gone_after_a_failed_run(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", "sync=ps", "sync.servers=2", "world_size=2", "steps=100000", "device=cpu",
         f"hydra.run.dir={out}", "timeouts.collective_s=30"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_steps(out)
        victim = next(p for log in (out / "logs").glob("*/attempt_0/1/stdout.log")
                      for p in map(int, re.findall(r"rank 1/2 pid (\d+)", log.read_text())))
        os.kill(victim, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and summary["error"]["rank"] == 1
    pids = server_pids(out) + rank_pids(out)
    assert len(pids) == 4 and not [p for p in pids if alive(p)]
