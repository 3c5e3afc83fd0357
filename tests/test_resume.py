"""Checkpoint and resume: a run killed mid-way and resumed from its latest checkpoint ends bitwise
equal to one that was never interrupted, and its results cover the whole run."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import read_json, read_jsonl, run_cli

from analysis import elastic
from testbed import checkpoint
from testbed.config import ConfigError
from testbed.preflight import check_command_line
from testbed.results.summary import load_summaries

RUN = ["world_size=2", "steps=12", "warmup_steps=1", "launcher.echo_rank0=false"]


def run(tmp_path: Path, name: str, overrides: list[str], expect: int = 0) -> Path:
    job = tmp_path / name
    proc = run_cli([*RUN, *overrides, f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return job


Shared = Callable[..., Path]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Shared:
    """Runs that several tests read (the uninterrupted reference, the killed run), each made once:
    the same overrides, in any order, give the same job directory. Tests only read them."""
    root = tmp_path_factory.mktemp("shared")
    made: dict[tuple[str, ...], Path] = {}

    def job(overrides: list[str], expect: int = 0) -> Path:
        key = tuple(sorted(overrides))
        if key not in made:
            made[key] = run(root, f"job{len(made)}", overrides, expect)
        return made[key]

    return job


KILLED_AT_9 = ["checkpoint.every=4", "fault=kill_rank", "fault.step=9"]  # checkpoints after steps 3 and 7


@pytest.mark.parametrize("sync", ["allreduce", "ring", "local_sgd", "ps"])
def test_a_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path: Path, shared: Shared, sync: str) -> None:
    # Momentum makes the optimizer state matter; local SGD keeps one replica per rank.
    # The parameter server keeps the optimizer: its shards checkpoint and restore their own state.
    extra = {"local_sgd": ["sync.period=3"], "ps": ["sync.servers=2"]}.get(sync, [])
    setting = [f"sync={sync}", "optim.momentum=0.9", *extra]
    whole_dir = shared(setting)
    whole = read_json(whole_dir / "summary.json")
    killed = shared([*setting, *KILLED_AT_9], expect=1)
    assert checkpoint.checkpoint_step(checkpoint.latest(killed)) == 7  # after steps 3 and 7; killed in step 9
    resumed_dir = run(tmp_path, "resumed", [*setting, f"resume={killed}"])
    resumed = read_json(resumed_dir / "summary.json")
    assert resumed["status"] == "ok" and resumed["steps"] == 12
    assert resumed["param_hash"] == whole["param_hash"]  # every rank's replica, bitwise
    for rank in (0, 1):
        records = read_jsonl(resumed_dir / "metrics" / f"rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(12))
        assert [r["loss"] for r in records] == [r["loss"] for r in read_jsonl(whole_dir / "metrics" / f"rank{rank}.jsonl")]


@pytest.mark.parametrize("sync", ["allreduce", "ring", "ps"])
def test_a_restarted_run_ends_ok_and_bitwise_equal_to_an_uninterrupted_one(tmp_path: Path, shared: Shared, sync: str) -> None:
    # The parameter server's shards are started again too, from their own part of the checkpoint.
    setting = [f"sync={sync}", "optim.momentum=0.9", *(["sync.servers=2"] if sync == "ps" else [])]
    whole_dir = shared(setting)
    whole = read_json(whole_dir / "summary.json")
    job = run(tmp_path, "restarted", [*setting, *KILLED_AT_9, "launcher.max_restarts=2"])
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["restarts"] == 1 and summary["steps"] == 12
    assert summary["param_hash"] == whole["param_hash"]  # restarted after step 7, bitwise as if never killed
    (failure,) = summary["attempts"]
    assert failure["error"]["kind"] == "killed" and failure["error"]["rank"] == 1 and failure["resumed_from_step"] == 7
    assert 0 < failure["restart_s"] <= failure["downtime_s"] < 60
    assert read_json(job / "attempts" / "0" / "summary.json")["status"] == "failed"  # each attempt's failure kept
    # What analysis.elastic sets against an elastic run's loss: steps 8 and 9 done again.
    (row,) = elastic.table(load_summaries([job])).to_dict("records")
    assert (row["recovery"], row["redone_steps"], row["downtime_s"]) == ("restart", 2, failure["downtime_s"])
    assert elastic.samples_over_time(job)[1][-1] == 12 * summary["global_batch"]
    for rank in (0, 1):
        records = read_jsonl(job / "metrics" / f"rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(12))
        assert [r["loss"] for r in records] == [r["loss"] for r in read_jsonl(whole_dir / "metrics" / f"rank{rank}.jsonl")]


@pytest.mark.parametrize("sync", ["ps_async", "ps_ssp"])
def test_async_and_ssp_restart_from_the_servers_snapshot_at_the_checkpoint_step(tmp_path: Path, sync: str) -> None:
    # No two async runs interleave alike, so no bitwise reference: what must hold is that the shards
    # snapshot at the step every worker checkpointed, and the next attempt goes on from that state.
    job = run(tmp_path, "restarted", [f"sync={sync}", "sync.servers=2", "optim.momentum=0.9", "checkpoint.every=4",
                                      "fault=kill_rank", "fault.step=9", "launcher.max_restarts=1"])  # fmt: skip
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["restarts"] == 1 and summary["attempts"][0]["resumed_from_step"] == 7
    for shard in (0, 1):
        snapshot = torch.load(job / "attempts" / "0" / "checkpoints" / "step0000007" / f"ps{shard}.pt", weights_only=False)
        assert (snapshot["mode"], snapshot["clocks"], snapshot["version"]) == (sync.removeprefix("ps_"), [8, 8], 16)
        assert sum(snapshot["histogram"].values()) == snapshot["stats"]["pushes"] == 16
        # The restored shard's counts went on from the snapshot's: the whole run's 2 x 12 pushes.
        stats = summary["sync_facts"]["server_stats"][shard]
        assert stats["version"] == stats["pushes"] == sum(stats["staleness_histogram"]) == 24
    for rank in (0, 1):
        records = read_jsonl(job / "metrics" / f"rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(12)) and all(math.isfinite(r["loss"]) for r in records)


def test_a_nonfinite_loss_is_not_restarted(tmp_path: Path) -> None:
    # From the same checkpoint the same steps diverge again, bitwise: a restart would only repeat them.
    job = run(tmp_path, "job", ["fault=nan_loss", "fault.step=3", "launcher.max_restarts=2"], expect=1)
    summary = read_json(job / "summary.json")
    assert summary["error"]["kind"] == "nonfinite_loss" and summary["restarts"] == 0 and summary["attempts"] == []
    assert not (job / "attempts").exists()


def test_checkpoints_keep_the_newest(tmp_path: Path) -> None:
    job = run(tmp_path, "job", ["checkpoint.every=2", "checkpoint.keep=2"])
    kept = sorted(p.name for p in (job / "checkpoints").glob("step*"))
    assert kept == ["step0000007", "step0000009"]  # after steps 1, 3, ..., 9; none after the last
    assert checkpoint.latest(job).name == "step0000009"
    assert sorted(p.name for p in (job / "checkpoints" / "step0000009").iterdir()) == ["manifest.json", "rank0.pt", "rank1.pt"]
    manifest = json.loads((job / "checkpoints" / "step0000009" / "manifest.json").read_text())
    assert manifest["step"] == 9 and sorted(manifest["files"]) == ["rank0.pt", "rank1.pt"]


def test_a_corrupted_newest_checkpoint_is_named_and_resume_falls_back_to_the_one_before(tmp_path: Path, shared: Shared) -> None:
    setting = ["sync=ps", "sync.servers=2", "optim.momentum=0.9"]  # the shards' files are in the manifest too
    whole = read_json(shared(setting) / "summary.json")
    killed = shutil.copytree(shared([*setting, *KILLED_AT_9], expect=1), tmp_path / "killed")  # corrupted below
    newest = killed / "checkpoints" / "step0000007"
    assert sorted(json.loads((newest / "manifest.json").read_text())["files"]) == ["ps0.pt", "ps1.pt", "rank0.pt", "rank1.pt"]
    corrupted = newest / "ps1.pt"
    corrupted.write_bytes(corrupted.read_bytes()[:-100])  # truncated
    job = tmp_path / "resumed"
    proc = run_cli([*RUN, *setting, f"resume={killed}", f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"checkpoint {corrupted}: its sha256 differs from manifest.json's (truncated or corrupted since it was "
            "written); falling back to step0000003") in proc.stdout + proc.stderr
    resumed = read_json(job / "summary.json")
    assert resumed["status"] == "ok" and resumed["param_hash"] == whole["param_hash"]  # from step 3, still bitwise


def test_only_checkpoints_complete_by_their_manifest_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # What restart (launcher.max_restarts) and resume both ask: testbed.launch.job and testbed.config.
    def step(n: int, manifest: bool = True) -> Path:
        path = checkpoint.step_dir(tmp_path, n)
        path.mkdir(parents=True)
        torch.save({"step": n}, path / "rank0.pt")
        if manifest:
            checkpoint.write_manifest(path)
        return path

    step(3)
    step(7).joinpath("rank0.pt").write_bytes(b"not what was written")
    listed = step(9)
    (listed / "rank0.pt").unlink()
    step(11, manifest=False)
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 3)
    assert checkpoint.continuable(tmp_path, steps=12)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        f"checkpoint {tmp_path}/checkpoints/step0000011: no manifest.json (the run stopped while writing this "
        "checkpoint); falling back to step0000003",
        f"checkpoint {listed}/rank0.pt: missing (listed in manifest.json); falling back to step0000003",
        f"checkpoint {tmp_path}/checkpoints/step0000007/rank0.pt: its sha256 differs from manifest.json's (truncated "
        "or corrupted since it was written); falling back to step0000003",
    ]
    unreadable = step(13)
    (unreadable / "rank0.pt").write_bytes(b"not a checkpoint")
    checkpoint.write_manifest(unreadable)  # complete by its manifest, yet no checkpoint
    with pytest.raises(RuntimeError, match=rf"checkpoint {unreadable}/rank0.pt: cannot be read \(UnpicklingError: "):
        checkpoint.load(tmp_path, 0)


def test_a_run_into_a_finished_runs_directory_is_refused_and_changes_nothing(tmp_path: Path, shared: Shared) -> None:
    finished = shared(["sync=allreduce", "optim.momentum=0.9"])
    before = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()}
    proc = run_cli([*RUN, "sync=allreduce", "optim.momentum=0.9", "steps=20", f"resume={finished}",
                    f"hydra.run.dir={finished}"], cwd=tmp_path)
    assert proc.returncode == 2 and f"hydra.run.dir={finished} holds a run's results" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()} == before  # Hydra's config and log too
    # A sweep into a finished sweep's directory likewise, unless it goes on with it (sweep_resume).
    sweep = tmp_path / "sweep"
    (sweep / "0_sync=ring").mkdir(parents=True)
    (sweep / "0_sync=ring" / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds the results of a sweep"):
        check_command_line(["-m", *RUN, "sync=ring,allreduce", f"hydra.sweep.dir={sweep}", "device=cpu"])
    check_command_line(["-m", *RUN, "sync=ring,allreduce", f"hydra.sweep.dir={sweep}", "sweep_resume=true", "device=cpu"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["resume={job}", "optim.lr=0.5"], "the config differs in optim"),
        (["resume={empty}"], "no complete checkpoint there (run it with checkpoint.every > 0)"),
        (["sync=ps", "sync.addresses=[127.0.0.1:1]", "checkpoint.every=2"], "checkpoint/resume with sync=ps: the servers save"),
        (["checkpoint.keep=0"], "checkpoint.keep=0: must be >= 1"),
        (["launcher.max_restarts=-1"], "launcher.max_restarts=-1: must be an integer >= 0"),
    ],
)
def test_bad_resume_configs_fail_before_anything_starts(tmp_path: Path, overrides: list[str], message: str) -> None:
    job = run(tmp_path, "job", ["checkpoint.every=4"]) if any("{job}" in o for o in overrides) else None
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [o.format(job=job, empty=empty) for o in overrides]
    with pytest.raises(ConfigError) as info:  # what the CLI runs before anything (test_config runs the CLI)
        check_command_line([*RUN, *args, "device=cpu"])  # as run_cli ran the job
    assert message in str(info.value)
