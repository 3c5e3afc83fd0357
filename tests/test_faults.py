"""Injected faults end a run cleanly: ``failed``, what failed and where, within the timeout, the
steps done so far kept, the sweep going on, and no process, namespace or temporary directory left."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import assert_nothing_left, read_json, read_jsonl, run_cli
from omegaconf import OmegaConf

from testbed.checks import ConfigError
from testbed.faults import fault_step
from testbed.preflight import check_command_line

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulated networks need root and iproute2",
)
QUICK = ["steps=12", "warmup_steps=1", "launcher.echo_rank0=false"]


def failed_job(tmp_path: Path, overrides: list[str], timeout: float = 300) -> tuple[dict, Path, float]:
    job = tmp_path / "job"
    began = time.monotonic()
    proc = run_cli([*overrides, *QUICK, f"hydra.run.dir={job}"], cwd=tmp_path, timeout=timeout)
    elapsed = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "failed"
    return summary, job, elapsed


def test_a_killed_rank_is_named_and_the_sweep_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # The fault's step is drawn from the seed: seed 3 puts it at fault_step(..., 3, 12).
    proc = run_cli(["-m", "world_size=2", "fault=kill_rank,none", "seed=3", *QUICK, f"hydra.sweep.dir={sweep}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed, healthy = (read_json(next(sweep.glob(f"{i}_*")) / "summary.json") for i in (0, 1))
    assert healthy["status"] == "ok"
    step = fault_step(OmegaConf.create({"name": "kill_rank", "step": None}), 3, 12)
    assert fault_step(OmegaConf.create({"name": "kill_rank", "step": None}), 4, 12) != step  # seeded, not fixed
    error = killed["error"]
    assert killed["status"] == "failed" and error["kind"] == "killed" and error["rank"] == 1 and error["step"] == step
    job = next(sweep.glob("0_*"))
    assert [r["step"] for r in read_jsonl(job / "metrics" / "rank0.jsonl")][:step] == list(range(step))  # kept
    assert_nothing_left(job)


def test_a_nan_loss_stops_the_run_at_its_step(tmp_path: Path) -> None:
    summary, job, _ = failed_job(tmp_path, ["world_size=2", "fault=nan_loss", "fault.rank=1", "fault.step=3"])
    error = summary["error"]
    assert error["kind"] == "nonfinite_loss" and error["rank"] == 1, error
    assert "loss is nan at step 3" in error["message"]
    records = read_jsonl(job / "metrics" / "rank1.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and math.isnan(records[3]["loss"])  # recorded, then stopped
    assert_nothing_left(job)


def test_a_killed_parameter_server_is_reported(tmp_path: Path) -> None:
    summary, job, _ = failed_job(tmp_path, ["world_size=2", "sync=ps", "sync.servers=2", "fault=kill_ps", "fault.shard=1",
                                            "fault.step=5"])
    error = summary["error"]
    assert error["kind"] == "parameter_server" and error["shard"] == 1 and "ps shard 1" in error["message"], error
    assert error["step"] in (4, 5)  # the peer may still be pulling step 4 when rank 0 kills the shard
    assert_nothing_left(job)


def test_a_stalled_rank_is_named_within_the_timeout(tmp_path: Path) -> None:
    # Rank 1 sleeps a minute before every forward pass; its peers give up after 8 s.
    summary, job, elapsed = failed_job(tmp_path, ["world_size=3", "imbalance=straggler", "imbalance.ranks=[1]",
                                                  "imbalance.slowdown=0", "imbalance.delay_ms=60000",
                                                  "timeouts.collective_s=8"])
    error = summary["error"]
    assert error["kind"] == "stall" and error["rank"] == 1 and error["missing"] == [1], error
    assert error["reporter"] in (0, 2) and "did not arrive" in error["message"]
    assert elapsed < 8 + 40  # the timeout, start-up and shutdown; not the straggler's minute
    assert_nothing_left(job)


@needs_root
def test_a_link_taken_down_names_its_rank(tmp_path: Path) -> None:
    summary, job, elapsed = failed_job(tmp_path, ["world_size=2", "network=emulated", "fault=link_down", "fault.rank=1",
                                                  "fault.step=4", "fault.duration_s=120", "timeouts.collective_s=10"])
    error = summary["error"]
    assert error["kind"] == "stall" and error["missing"] == [1] and error["reporter"] == 0, error
    assert elapsed < 10 + 40
    assert_nothing_left(job)


@needs_root
def test_a_short_link_outage_is_survived(tmp_path: Path) -> None:
    job = tmp_path / "job"
    proc = run_cli(["world_size=2", "network=emulated", "fault=link_down", "fault.rank=1", "fault.step=4",
                    "fault.duration_s=2", "timeouts.collective_s=30", *QUICK, f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"]
    slow = max(r["t_step"] for r in read_jsonl(job / "metrics" / "rank0.jsonl"))
    assert slow > 1.5  # the step of the outage waited for the link to come back


def test_debug_turns_on_torch_distributed_diagnostics(tmp_path: Path) -> None:
    job = tmp_path / "job"
    proc = run_cli(["world_size=2", "debug=true", "steps=3", "warmup_steps=1", "launcher.echo_rank0=false",
                    f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (stderr,) = job.glob("logs/*/attempt_0/0/stderr.log")
    assert "CollectiveFingerPrint" in stderr.read_text()  # TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["fault=kill_rank", "fault.step=50", "steps=12"], "fault.step=50: must be in [0, steps=12)"),
        (["fault=kill_rank", "fault.rank=2", "world_size=2"], "fault.rank=2: must be in [0, world_size=2)"),
        (["fault=kill_ps", "sync=ring", "world_size=2"], "fault=kill_ps kills a parameter server"),
        (["fault=link_down", "world_size=2"], "fault=link_down takes an emulated link down: use network=emulated"),
    ],
)
def test_bad_fault_configs_fail_before_anything_starts(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:  # what the CLI runs before anything (test_config runs the CLI)
        check_command_line(overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["world_size=2"], "fault=link_slow re-shapes a rank's emulated link: use network=emulated"),
        (["world_size=2", "network=emulated", "fault.bandwidth=fast"], "fault.bandwidth=fast: 'fast': expected <number>"),
        (["world_size=4", "network=emulated", "network.nodes=2"],
         "two levels (network.nodes=2) leave unshaped: use network.nodes=0"),
    ],
)
def test_a_link_slowed_where_it_cannot_be_is_refused_in_the_preflight(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(["fault=link_slow", *overrides])
    assert message in str(info.value)
