"""Elastic membership: a lost worker leaves an all-reduce run, which goes on without a restart and
ends with the model of an uninterrupted run; the survivors never wait out a timeout; below
``elastic.min_workers`` the run fails and says why; bad settings are refused before any spawn."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from conftest import assert_nothing_left, load_params, read_json, read_jsonl, relative_error, run_cli
from hydra import compose, initialize_config_dir

from analysis import elastic
from testbed.checks import ConfigError
from testbed.config import to_plain, validate
from testbed.launch.virtual.run import run_virtual
from testbed.paths import config_dir
from testbed.preflight import check_command_line
from testbed.results.summary import load_summaries

QUICK = ["steps=16", "warmup_steps=1", "launcher.echo_rank0=false", "timeouts.collective_s=60"]
# 4 workers of 12 samples: a global batch of 48, which 3 (and 2) workers split evenly.
ELASTIC = ["world_size=4", "data.batch_size=12", "elastic.enabled=true", "elastic.min_workers=2",
           "fault=kill_rank", "fault.rank=2"]
AT_STEP_10 = ["elastic.rejoin_step=10", "elastic.rejoin_wait=true"]  # a newcomer's join, at exactly step 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ring and allreduce losing worker 2 of 4 (ring at step 7 with commits every 3 steps, so that a
    completed step is rolled back; allreduce at step 0, before any commit), ring and ps (sync mode,
    two shards) losing it at step 5 and a newcomer taking its place at step 10, ps in SSP mode
    losing it at step 5 and a newcomer joining from step 10 on, and one process on the whole global
    batch for reference."""
    root = tmp_path_factory.mktemp("elastic")
    proc = run_cli([*ELASTIC, *QUICK, "sync=ring", "elastic.commit_every=3", "fault.step=7",
                    f"hydra.run.dir={root / 'ring'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*ELASTIC, *QUICK, "sync=allreduce", "fault.step=0", f"hydra.run.dir={root / 'allreduce'}"],
                   cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*ELASTIC, *QUICK, "sync=ps", "sync.mode=ssp", "fault.step=5", *AT_STEP_10,
                    f"hydra.run.dir={root / 'ssp'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, sync in (("rejoin", ["sync=ring"]), ("ps_rejoin", ["sync=ps", "sync.servers=2"])):
        proc = run_cli([*ELASTIC, *QUICK, *sync, "fault.step=5", *AT_STEP_10,
                        f"hydra.run.dir={root / name}"], cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(["world_size=1", "data.batch_size=48", *QUICK, f"hydra.run.dir={root / 'one'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: root / name for name in ("ring", "allreduce", "ssp", "rejoin", "ps_rejoin", "one")}


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
    killed, resumed, rolled_back = {"ring": (7, 6, 1), "allreduce": (0, 0, 0)}[sync]
    assert (change["interrupted_step"], change["step"], change["rolled_back_steps"]) == (killed, resumed, rolled_back)
    # Woken by the new membership, not by the 60 s collective timeout.
    assert 0 <= change["regroup_s"] < 10 and change["regroup_s"] <= change["downtime_s"] < 15
    for worker in (0, 1, 3):  # each step once, the redone one with the survivors' share of the batch
        records = read_jsonl(job / "metrics" / f"rank{worker}.jsonl")
        assert [r["step"] for r in records] == list(range(16))
        assert {r["samples"] for r in records if r["step"] >= resumed} == {16}
    lost = read_jsonl(job / "metrics" / "rank2.jsonl")
    assert [r["step"] for r in lost] == list(range(killed))
    # The statistics are the survivors', by their names, and per survivor.
    assert {r["rank"] for r in summary["per_rank"]} == {0, 1, 3}
    assert summary["bytes_per_step"] * 3 == summary["bytes_per_step_total"]
    assert_nothing_left(job)


def test_keep_local_keeps_each_workers_batch_and_scales_the_rate_with_the_membership(tmp_path: Path) -> None:
    """4 -> 3 -> 4 workers of 10 samples (40 does not divide by 3: keep_global would be refused):
    every worker's batch stays 10, and the linear scaling rule's rate follows the global batch."""
    job = tmp_path / "job"
    proc = run_cli([*ELASTIC, *QUICK, "data.batch_size=10", "elastic.batch=keep_local", "optim.lr_scaling=linear",
                    "optim.lr=0.01", "sync=ring", "fault.step=5", *AT_STEP_10, f"hydra.run.dir={job}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary.get("error")
    assert [(c["step"], c["world_size"]) for c in summary["membership"]] == [(0, 4), (5, 3), (10, 4)]
    for worker in (0, 1, 3):
        records = read_jsonl(job / "metrics" / f"rank{worker}.jsonl")
        assert [r["step"] for r in records] == list(range(16)) and {r["samples"] for r in records} == {10}
        # base_batch is data.batch_size, so the peak rate is optim.lr times the workers
        assert [round(r["lr"] / 0.01, 6) for r in records] == [4.0] * 5 + [3.0] * 5 + [4.0] * 6
    assert [r["step"] for r in read_jsonl(job / "metrics" / "rank2.jsonl")] == [*range(5), *range(10, 16)]
    assert_nothing_left(job)


@pytest.mark.parametrize("run", ["rejoin", "ps_rejoin"])
def test_a_newcomer_takes_a_lost_workers_place_and_the_run_ends_with_the_uninterrupted_model(
    runs: dict[str, Path], run: str,
) -> None:
    """4 -> 3 -> 4: worker 2 lost at step 5; a newcomer in its place receives the model and optimizer
    state from a peer (ring), or is admitted by the servers (ps), and takes part from step 10, with
    nothing done again."""
    job = runs[run]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary.get("error")
    assert relative_error(load_params(job), load_params(runs["one"])) < 1e-5
    _, lost, joined = summary["membership"]
    assert (lost["members"], lost["lost"], lost["step"]) == ([0, 1, 3], [2], 5)
    # Step 5, interrupted, is done again and nothing else: ring commits every step; the servers
    # dropped step 5, short of worker 2's push, and the survivors pushed it again.
    assert (lost["interrupted_step"], lost["rolled_back_steps"]) == (5, 0)
    assert (joined["members"], joined["joined"], joined["lost"]) == ([0, 1, 2, 3], [2], [])
    assert (joined["step"], joined["interrupted_step"], joined["rolled_back_steps"]) == (10, None, 0)
    assert 0 <= joined["regroup_s"] <= joined["downtime_s"] < 15
    records = read_jsonl(job / "metrics" / "rank2.jsonl")  # the lost worker's steps, then the newcomer's
    assert [r["step"] for r in records] == [*range(5), *range(10, 16)]
    assert {r["samples"] for r in records} == {12}
    for worker in (0, 1, 3):
        samples = {r["step"]: r["samples"] for r in read_jsonl(job / "metrics" / f"rank{worker}.jsonl")}
        assert sorted(samples) == list(range(16)) and {samples[s] for s in range(5, 10)} == {16}
    assert_nothing_left(job)


def test_a_newcomer_not_ready_at_rejoin_step_joins_once_ready_and_nobody_waits_for_it(tmp_path: Path) -> None:
    """Without elastic.rejoin_wait the members train on until the newcomer is ready (it starts a
    process and builds its data) and admit it at the boundary after the one where worker 0 sees it
    ready: never at rejoin_step itself, and the join's pause is the join's own, not the newcomer's
    start."""
    job = tmp_path / "job"
    proc = run_cli([*ELASTIC, *QUICK, "steps=60", "sync=ring", "fault.step=2", "elastic.rejoin_step=3",
                    f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary.get("error")
    _, lost, joined = summary["membership"]
    assert joined["joined"] == [2] and joined["step"] > 3 and joined["interrupted_step"] is None
    assert joined["regroup_s"] < 1.0, joined
    newcomer = [r["step"] for r in read_jsonl(job / "metrics" / "rank2.jsonl")]
    assert newcomer == [0, 1, *range(joined["step"], 60)]
    assert_nothing_left(job)


@pytest.mark.skipif(os.geteuid() != 0, reason="an emulated network needs root (namespaces, tc)")
def test_over_an_emulated_network_a_worker_leaves_and_a_newcomer_joins(runs: dict[str, Path], tmp_path: Path) -> None:
    """The launcher's store listens in a namespace of its own, which the ranks' namespaces reach, and
    the servers hear of each change from the workers: 4 -> 3 -> 4 over 1 Gbit links ends with the
    uninterrupted model, and takes every namespace down with it."""
    job = tmp_path / "job"
    proc = run_cli([*ELASTIC, *QUICK, "sync=ps", "network=emulated", "network.bandwidth=1gbit", "fault.step=5",
                    *AT_STEP_10, f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary.get("error")
    assert relative_error(load_params(job), load_params(runs["one"])) < 1e-5
    assert [(c["step"], c["members"]) for c in summary["membership"]] == [
        (0, [0, 1, 2, 3]), (5, [0, 1, 3]), (10, [0, 1, 2, 3])]
    assert_nothing_left(job)


@pytest.mark.parametrize(("run", "overrides"), [
    ("ring", ["sync=ring", "elastic.commit_every=3", "fault.step=7"]),
    ("ps_rejoin", ["sync=ps", "sync.servers=2", "fault.step=5", *AT_STEP_10]),
])
def test_a_virtual_cluster_loses_and_admits_a_worker_as_the_real_run_does(
    runs: dict[str, Path], tmp_path: Path, run: str, overrides: list[str],
) -> None:
    """The same loss (and join) on a virtual cluster (testbed.launch.virtual.membership): the real
    run's model, its memberships' steps, and its workers' steps."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *ELASTIC, *(o for o in QUICK if not o.startswith("launcher.")), *overrides, "launcher=virtual",
            "cluster=here", "cluster.compute.ms_per_sample=0.05"])
    validate(cfg)
    summary = run_virtual(cfg, to_plain(cfg), tmp_path)
    assert relative_error(load_params(tmp_path), load_params(runs[run])) < 1e-6
    keys = ("step", "members", "lost", "joined", "interrupted_step", "rolled_back_steps")
    real = read_json(runs[run] / "summary.json")["membership"]
    assert [{k: e.get(k) for k in keys} for e in summary["membership"]] == [{k: e.get(k) for k in keys} for e in real]
    for worker in range(4):
        steps = [[r["step"] for r in read_jsonl(job / "metrics" / f"rank{worker}.jsonl")] for job in (tmp_path, runs[run])]
        assert steps[0] == steps[1], worker


def test_ssp_workers_go_on_when_the_servers_drop_a_lost_one_and_take_a_newcomer_in(runs: dict[str, Path]) -> None:
    """No step waits for the lost worker: the survivors regroup at their next step, where they are.
    The newcomer joins once every member has reached step 10 and knows of the loss, at the slowest
    member's clock."""
    summary = read_json(runs["ssp"] / "summary.json")
    assert summary["status"] == "ok", summary.get("error")
    _, lost, joined = summary["membership"]
    assert lost["members"] == [0, 1, 3] and lost["interrupted_step"] is None and lost["rolled_back_steps"] == 0
    assert lost["step"] >= 5 and lost["regroup_s"] < 10
    assert joined["members"] == [0, 1, 2, 3] and joined["joined"] == [2] and joined["rolled_back_steps"] == 0
    assert joined["step"] >= 10 and joined["downtime_s"] < 15
    for worker in (0, 1, 3):
        assert [r["step"] for r in read_jsonl(runs["ssp"] / "metrics" / f"rank{worker}.jsonl")] == list(range(16))
    newcomer = [r["step"] for r in read_jsonl(runs["ssp"] / "metrics" / "rank2.jsonl")]
    assert newcomer[:5] == list(range(5)) and newcomer[5:] == list(range(newcomer[5], 16)) and newcomer[5] >= 10
    assert_nothing_left(runs["ssp"])


def test_the_analysis_reads_each_loss_from_the_summaries(runs: dict[str, Path], tmp_path: Path) -> None:
    summaries = load_summaries([runs[name] for name in ("ring", "allreduce", "ps_rejoin", "one")])
    frame = elastic.table(summaries).set_index("sync")
    label = {name: read_json(runs[name] / "summary.json")["sync_label"] for name in ("ring", "allreduce", "ps_rejoin")}
    assert set(frame.index) == set(label.values())  # one process lost no one and ran no launcher
    assert frame["recovery"].to_dict() == {label["ring"]: "elastic", label["allreduce"]: "elastic",
                                           label["ps_rejoin"]: "rejoin"}
    # The interrupted step and the completed ones rolled back: ring 6 and 7, the others their step.
    assert frame["redone_steps"].to_dict() == {label["ring"]: 2, label["allreduce"]: 1, label["ps_rejoin"]: 1}
    for name, sync in label.items():
        assert frame.loc[sync, "downtime_s"] == read_json(runs[name] / "summary.json")["membership"][1]["downtime_s"]
        times, samples = elastic.samples_over_time(runs[name])
        assert times == sorted(times) and times[0] > 0 and samples[-1] == 16 * 48  # every step of the final model once
    assert elastic.samples_over_time(runs["rejoin"])[1][-1] == 16 * 48  # the lost worker's step 5 is not in it
    figures, section = elastic.analyse(summaries, tmp_path)
    assert tmp_path / "elastic.png" in figures and "| ring | elastic | 1 |" in section


@pytest.mark.unit
def test_the_analysis_calls_a_recovery_first_to_target_only_outside_the_others_intervals() -> None:
    times = {"elastic": [4.0, 5.0, 6.0], "restart": [10.0, 11.0, 12.0], "uninterrupted": [3.0, 5.0, 7.5]}
    runs = pd.DataFrame([{"sync": "ring", "recovery": recovery, "seed": seed, "downtime_s": None, "redone_steps": None,
                          "join_s": None, "time_to_target_s": t} for recovery, ts in times.items()
                         for seed, t in enumerate(ts)])
    rows = elastic.summary_rows(runs).set_index("recovery")
    assert rows["verdict"].to_dict() == {"elastic": "best", "restart": "", "uninterrupted": "tie"}
    assert rows.loc["elastic", "to_target"] == "5.00 (2.52-7.48)"


def test_a_survivor_never_hangs_wherever_the_loss_strikes(tmp_path: Path) -> None:
    """Worker 2 killed at a step drawn from each of five seeds, the others anywhere in that step's
    ring (some blocked on a live peer): every run regroups within seconds, far inside the
    collective timeout, and ends ok."""
    quick = [o for o in QUICK if not o.startswith("timeouts.")]
    proc = run_cli(["-m", *ELASTIC, *quick, "sync=ring", "timeouts.collective_s=20", "seed=1,2,3,4,5",
                    f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent for p in tmp_path.glob("*/summary.json"))
    assert len(jobs) == 5
    for job in jobs:
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok", summary.get("error")
        change = summary["membership"][1]
        assert change["lost"] == [2] and change["regroup_s"] < 5, change
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
        (["sync=byteps"], "elastic.enabled with sync=byteps: its summation service"),
        (["sync=ps", "sync.backup_workers=1"], "elastic.enabled with sync.backup_workers"),
        (["sync=ddp"], "elastic.enabled with sync=ddp: DDP's reducer"),
        (["fault.rank=0"], "elastic.enabled with fault.rank=0"),
        (["launcher.max_restarts=1"], "elastic.enabled with launcher.max_restarts"),
        (["fault.step=8", "elastic.rejoin_step=8"], "set fault.step below elastic.rejoin_step"),
        (["network=emulated", "network.nodes=2"], "elastic.enabled with network.nodes"),
        (["elastic.batch=keep_all"], "elastic.batch=keep_all: allowed: keep_global|keep_local"),
        (["data.batch_size=10", "elastic.min_workers=3"], "or keep each worker's batch instead (elastic.batch=keep_local)"),
        (["sync=ps", "elastic.batch=keep_local", "optim.lr_scaling=linear"],
         "elastic.batch=keep_local with sync=ps and optim.lr_scaling=linear"),
    ],
)
def test_elastic_settings_that_cannot_run_are_refused_before_spawn(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line([*ELASTIC, *overrides])
    assert message in str(info.value)


@pytest.mark.unit
def test_the_presets_recoveries_compose_for_every_synchronizer() -> None:
    assert check_command_line(["+experiment=elastic"]) == 3 * 4 * 4
