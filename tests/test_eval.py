"""Held-out evaluation end to end: every synchronizer's metrics equal one process's, the parameter
server steps with the trainer's schedule, an asynchronous server's model is the servers', local
SGD's is the replicas' average, and a target stops every rank where the summary says.

One module fixture runs the shared jobs (about a minute on two cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli
from omegaconf import OmegaConf

from testbed.checkpoint import step_dir
from testbed.data import build_heldout, spec_for
from testbed.eval.metrics import SUMS, batch_sums, metrics_from
from testbed.eval.schedule import schedule_of
from testbed.models import build_model

TOL = 1e-5
# mnist1d's 400 training and 100 held-out signals; a global batch of 60 split alike at n = 1, 2, 3;
# warmup and a cosine decay, so that the servers' schedule is tested too.
COMMON = [
    "data=mnist1d", "data.num_samples=500", "data.scaling=strong", "data.batch_size=60", "model.hidden=32",
    "steps=6", "warmup_steps=1", "eval.every=3", "optim.warmup_steps=3", "optim.schedule=cosine",
    "launcher.echo_rank0=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    jobs = {
        "ref": ["sync=none", "world_size=1"],
        "sweep": ["-m", "sync=allreduce,ps", "world_size=2,3"],
        # Rank 1 is late to every step, so rank 0's own copy misses its last updates at evaluation.
        "async": ["sync=ps", "sync.mode=async", "world_size=2", "imbalance=straggler", "imbalance.ranks=[1]",
                  "imbalance.delay_ms=40"],
        # Never averaged during the run: the replicas drift apart.
        "local_sgd": ["sync=local_sgd", "sync.period=100", "world_size=2", "checkpoint.every=3"],
        # Any model meets a loss of 100: the first evaluation stops the run.
        "stop": ["sync=allreduce", "world_size=2", "target.metric=loss", "target.value=100", "target.stop=true",
                 "checkpoint.every=1"],
    }
    dirs = {}
    for name, args in jobs.items():
        out = root / name
        key = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
        proc = run_cli([*args, *COMMON, f"{key}={out}"], cwd=root, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        dirs[name] = out
    return dirs


def evaluate_params(job: Path, params: dict[str, torch.Tensor]) -> dict[str, float]:
    """The job's held-out metrics of ``params``, computed here in one piece."""
    cfg = OmegaConf.create(read_json(job / "summary.json")["config"])
    spec = spec_for(cfg.data)
    model = build_model(cfg.model, spec)
    model.load_state_dict(params)
    model.eval()
    held = build_heldout(cfg.data, cfg.seed)
    sums = torch.zeros(len(SUMS), dtype=torch.float64)
    with torch.no_grad():
        inputs, targets = held.take(range(len(held)))
        sums += batch_sums(model(inputs), targets)
    return metrics_from(sums, spec)


def sweep_jobs(sweep: Path) -> dict[str, Path]:
    return {f"{s['sync']}-{s['world_size']}": d for d in sweep.iterdir()
            if (d / "summary.json").exists() and (s := read_json(d / "summary.json"))}


def test_every_synchronizer_evaluates_what_one_process_does(runs: dict[str, Path]) -> None:
    ref_rows = read_jsonl(runs["ref"] / "metrics" / "eval.jsonl")
    assert [r["step"] for r in ref_rows] == [2, 5] and all(r["samples"] == 100 for r in ref_rows)
    jobs = sweep_jobs(runs["sweep"])
    assert set(jobs) == {"allreduce-2", "allreduce-3", "ps-2", "ps-3"}
    for name, job in jobs.items():
        rows = read_jsonl(job / "metrics" / "eval.jsonl")
        assert [r["step"] for r in rows] == [2, 5], name
        for row, ref in zip(rows, ref_rows):
            assert row["model"] == "replicas" and row["samples_seen"] == ref["samples_seen"] == (row["step"] + 1) * 60
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), name
            assert row["accuracy"] == pytest.approx(ref["accuracy"], abs=0.011), name  # one sample of 100 at most
        summary = read_json(job / "summary.json")
        assert summary["eval"]["final"]["step"] == 5 and summary["eval"]["evaluations"] == 2
        # The parameter server steps with the trainer's schedule, warmup and cosine included.
        assert relative_error(load_params(job), load_params(runs["ref"])) <= TOL, name
    final = evaluate_params(runs["ref"], load_params(runs["ref"]))
    assert final["loss"] == pytest.approx(ref_rows[-1]["loss"], rel=1e-5)


def test_the_step_log_carries_the_schedules_rate(runs: dict[str, Path]) -> None:
    cfg = OmegaConf.create(read_json(runs["ref"] / "summary.json")["config"])
    schedule = schedule_of(cfg, 400)
    records = read_jsonl(runs["ref"] / "metrics" / "rank0.jsonl")
    assert [r["lr"] for r in records] == pytest.approx([schedule.lr_at(s) for s in range(6)])
    assert records[0]["lr"] < records[2]["lr"] > records[5]["lr"]  # up through warmup, then down


def test_an_async_servers_model_is_evaluated_not_a_workers_stale_copy(runs: dict[str, Path]) -> None:
    job = runs["async"]
    rows = read_jsonl(job / "metrics" / "eval.jsonl")
    assert [r["model"] for r in rows] == ["servers", "servers"]
    last = rows[-1]
    assert last["rank0_behind"] >= 1, "rank 0's own copy was not stale: the test proves nothing"
    # Evaluated after every worker's last push: the servers' final parameters, which model_final.pt holds.
    assert evaluate_params(job, load_params(job))["loss"] == pytest.approx(last["loss"], rel=1e-5)


def test_local_sgd_evaluates_the_replicas_average(runs: dict[str, Path]) -> None:
    job = runs["local_sgd"]
    row = read_jsonl(job / "metrics" / "eval.jsonl")[0]
    assert row["model"] == "replica average" and row["step"] == 2
    replicas = [torch.load(step_dir(job, 2) / f"rank{r}.pt", weights_only=False)["model"] for r in (0, 1)]
    assert relative_error(replicas[0], replicas[1]) > 1e-4, "the replicas did not drift: the test proves nothing"
    average = {k: (replicas[0][k] + replicas[1][k]) / 2 for k in replicas[0]}
    assert evaluate_params(job, average)["loss"] == pytest.approx(row["loss"], rel=1e-5)
    assert evaluate_params(job, replicas[0])["loss"] != pytest.approx(row["loss"], rel=1e-4)


def test_a_target_with_stop_ends_every_rank_at_its_first_evaluation(runs: dict[str, Path]) -> None:
    job = runs["stop"]
    summary = read_json(job / "summary.json")
    reached = summary["time_to_target"]
    assert summary["status"] == "ok" and reached["reached"] and reached["status"] == "reached"
    assert reached["steps"] == 3 and reached["samples"] == 180 and summary["steps"] == 3
    assert reached["epochs"] == pytest.approx(180 / 400)  # of the 400 training signals
    rows = read_jsonl(job / "metrics" / "eval.jsonl")
    assert len(rows) == 1 and reached["seconds"] == rows[0]["time_s"]
    assert 0 < reached["t_eval_share"] < 1
    for rank in (0, 1):
        assert [r["step"] for r in read_jsonl(job / "metrics" / f"rank{rank}.jsonl")] == [0, 1, 2]
    # Checkpoints stop with the run (step 2's is the last, the run's end needs none).
    saved = sorted(p.name for p in step_dir(job, 0).parent.iterdir())
    assert saved and saved[-1] <= step_dir(job, 2).name


def test_the_tuner_ranks_by_time_to_the_heldout_target(runs: dict[str, Path]) -> None:
    from testbed.tune.space import Candidate
    from testbed.tune.trials import Measured, add_time_to_target, rank

    reached = Measured(Candidate(("sync=allreduce",)), jobs=[runs["stop"]])
    never = Measured(Candidate(("sync=none",)), jobs=[runs["ref"]])  # no target: nothing to rank it by
    target = add_time_to_target([never, reached])
    assert target == {"metric": "loss", "value": 100.0}
    assert reached.time_to_target == [read_json(runs["stop"] / "summary.json")["time_to_target"]["seconds"]]
    assert never.time_to_target == [] and rank([never, reached], "time_to_target")[0] is reached


def test_analysis_draws_accuracy_and_the_target_table(runs: dict[str, Path], tmp_path: Path) -> None:
    from analysis.__main__ import main

    assert main([str(runs["ref"]), str(runs["sweep"]), str(runs["stop"]), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "accuracy.png").stat().st_size > 0 and (tmp_path / "time_to_target.png").exists()
    report = (tmp_path / "report.md").read_text()
    section = report.split("## Time to the held-out target")[1].split("##")[0]
    assert "| allreduce |" in section and "loss 100" in section and "| best |" in section
    assert "## Final held-out accuracy" in report
