"""Elastic membership: a lost worker leaves an all-reduce run, which goes on without a restart and
ends with the model of an uninterrupted run; the survivors never wait out a timeout; below
``elastic.min_workers`` the run fails and says why; bad settings are refused before any spawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_nothing_left, load_params, read_json, read_jsonl, relative_error, run_cli

from testbed.checks import ConfigError
from testbed.preflight import check_command_line

QUICK = ["steps=16", "warmup_steps=1", "launcher.echo_rank0=false", "timeouts.collective_s=60"]
# 4 workers of 12 samples: a global batch of 48, which 3 (and 2) workers split evenly.
ELASTIC = ["world_size=4", "data.batch_size=12", "elastic.enabled=true", "elastic.min_workers=2",
           "fault=kill_rank", "fault.rank=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ring and allreduce losing worker 2 of 4 (ring at step 7 with commits every 3 steps, so that a
    completed step is rolled back; allreduce at step 0, before any commit), and one process on the
    whole global batch for reference."""
    root = tmp_path_factory.mktemp("elastic")
    proc = run_cli([*ELASTIC, *QUICK, "sync=ring", "elastic.commit_every=3", "fault.step=7",
                    f"hydra.run.dir={root / 'ring'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*ELASTIC, *QUICK, "sync=allreduce", "fault.step=0", f"hydra.run.dir={root / 'allreduce'}"],
                   cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(["world_size=1", "data.batch_size=48", *QUICK, f"hydra.run.dir={root / 'one'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ring": root / "ring", "allreduce": root / "allreduce", "one": root / "one"}


@pytest.mark.parametrize("sync", ["ring", "allreduce"])
def test_a_lost_worker_leaves_and_the_run_ends_with_the_uninterrupted_model(runs: dict[str, Path], sync: str) -> None:
    job = runs[sync]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary.get("error")
    assert relative_error(load_params(job), load_params(runs["one"])) < 1e-5
    start, change = summary["membership"]
    assert start == {"epoch": 0, "step": 0, "world_size": 4, "members": [0, 1, 2, 3], "cause": "start"}
    assert change["members"] == [0, 1, 3] and change["lost"] == [2] and "SIGKILL" in change["cause"]
    # ring: commits after steps 2 and 5; killed at step 7, so step 6, completed, is done again.
    resumed, rolled_back = (6, 1) if sync == "ring" else (0, 0)
    assert (change["step"], change["interrupted_step"], change["rolled_back_steps"]) == (resumed, 7 if sync == "ring" else 0, rolled_back)
    # Woken by the new membership, not by the 60 s collective timeout.
    assert 0 <= change["regroup_s"] < 10 and change["regroup_s"] <= change["downtime_s"] < 15
    for worker in (0, 1, 3):  # each step once, the redone one with the survivors' share of the batch
        records = read_jsonl(job / "metrics" / f"rank{worker}.jsonl")
        assert [r["step"] for r in records] == list(range(16))
        assert {r["samples"] for r in records if r["step"] >= resumed} == {16}
    lost = read_jsonl(job / "metrics" / "rank2.jsonl")
    assert [r["step"] for r in lost] == list(range(7 if sync == "ring" else 0))
    assert_nothing_left(job)


def test_below_min_workers_the_run_fails_and_says_why(tmp_path: Path) -> None:
    job = tmp_path / "job"
    proc = run_cli([*ELASTIC, *QUICK, "world_size=2", "elastic.min_workers=2", "fault.rank=1", "fault.step=3",
                    "data.batch_size=12", f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 1
    error = read_json(job / "summary.json")["error"]
    assert error["rank"] == 1 and "below elastic.min_workers=2" in error["message"], error
    assert_nothing_left(job)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["elastic.min_workers=5"], "elastic.min_workers=5: must be in [1, world_size=4]"),
        (["data.batch_size=10", "elastic.min_workers=3"], "does not divide among 3 workers"),
        (["sync=ps"], "elastic.enabled with sync=ps: the parameter servers do not drop a lost worker"),
        (["sync=ddp"], "elastic.enabled with sync=ddp: DDP's reducer"),
        (["fault.rank=0"], "elastic.enabled with fault.rank=0"),
        (["launcher.max_restarts=1"], "elastic.enabled with launcher.max_restarts"),
    ],
)
def test_elastic_settings_that_cannot_run_are_refused_before_spawn(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line([*ELASTIC, *overrides])
    assert message in str(info.value)
