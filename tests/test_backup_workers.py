"""Backup workers (sync=ps sync.backup_workers=b): each update is the mean of exactly the first
n - b gradients, a late worker catches up, and b = 0 is plain synchronous training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli
from hydra import compose, initialize_config_dir

from testbed.config import ConfigError
from testbed.data import build_data
from testbed.imbalance import shard_batches
from testbed.models import build_model, objective_batches
from testbed.models.call import model_call
from testbed.optim import build_optimizer
from testbed.paths import config_dir
from testbed.preflight import check_command_line

TOL = 1e-5
STEPS = 10
# Rank 2 waits 80 ms before each forward pass: the others' gradients of a step (a few ms) are in first.
RUN = ["sync=ps", "world_size=3", f"steps={STEPS}", "warmup_steps=1", "data.scaling=strong", "data.batch_size=60",
       "data.num_samples=120", "data.shape=[24]", "model.hidden=32", "imbalance=straggler", "imbalance.ranks=[2]",
       "imbalance.slowdown=0", "imbalance.delay_ms=80", "stats.noise_scale=true", "launcher.echo_rank0=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backup")
    proc = run_cli(["-m", *RUN, "sync.backup_workers=0,1", f"hydra.sweep.dir={root / 'sweep'}",
                    "hydra.sweep.subdir=b${sync.backup_workers}"], cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_cli([*RUN, f"hydra.run.dir={root / 'plain'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"b0": root / "sweep" / "b0", "b1": root / "sweep" / "b1", "plain": root / "plain"}


def test_no_backup_workers_is_bitwise_plain_synchronous_training(runs: dict[str, Path]) -> None:
    b0, plain = read_json(runs["b0"] / "summary.json"), read_json(runs["plain"] / "summary.json")
    assert b0["status"] == plain["status"] == "ok" and b0["sync_label"] == "ps-sync"
    assert b0["param_hash"] == plain["param_hash"] and "backup" not in b0


def replay(chosen: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """One process trains the run's model step by step on the batches of exactly the ranks that
    ``chosen[step]`` names, averaged in rank order, with the servers' optimizer: the final model, and
    each step's mean squared norm of those ranks' gradients and squared norm of their average."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*RUN, "sync.backup_workers=1", "device=cpu"])
    sizes = shard_batches(cfg)
    streams = []
    for rank in range(cfg.world_size):
        spec, data = build_data(cfg.data, sizes, rank, cfg.seed, "cpu")
        streams.append(objective_batches(cfg.model, data, spec, cfg.seed, rank))
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, spec)
    optimizer = build_optimizer(cfg.optim, model.parameters())
    call = model_call(cfg.model)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for step, ranks in enumerate(chosen):
        grads = []
        for rank in ranks:
            model.zero_grad(set_to_none=True)
            call(model, *streams[rank].batch(step)).loss.backward()
            grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            total = grads[0][i].clone()
            for more in grads[1:]:
                total.add_(more[i])
            p.grad = total.div_(len(ranks))
        local_sq = [sum(float(g.double().pow(2).sum()) for g in grad) for grad in grads]
        norms.append((sum(local_sq) / len(ranks), sum(float(p.grad.double().pow(2).sum()) for p in params)))
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


def test_each_update_is_the_mean_of_exactly_the_first_gradients(runs: dict[str, Path]) -> None:
    job = runs["b1"]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["sync_label"] == "ps-sync b=1"
    logs = [{r["step"]: r for r in read_jsonl(job / "metrics" / f"rank{rank}.jsonl")} for rank in range(3)]
    # Who the update of each step took: the ranks whose samples it counts (a late one's are 0).
    chosen = [[rank for rank in range(3) if logs[rank][step]["samples"] > 0] for step in range(STEPS)]
    assert all(len(ranks) == 2 for ranks in chosen), chosen
    late = [step for step in range(STEPS) if 2 not in chosen[step]]
    assert len(late) >= STEPS // 2, chosen  # the straggler's gradients are the ones left out
    for log in logs:  # a step is one of: taken (samples), dropped (computed, too late), sat out (no loss)
        assert all(r["dropped"] + (r["samples"] > 0) + (r["loss"] is None) == 1 for r in log.values()), log
    assert summary["backup"]["dropped"] == [sum(r["dropped"] for r in log.values()) for log in logs]
    assert summary["backup"]["sat_out"] == [sum(r["loss"] is None for r in log.values()) for log in logs]
    stats = summary["sync_facts"]["server_stats"][0]
    assert (stats["version"], stats["pushes"], stats["rejected"]) == (STEPS, 2 * STEPS, 0)  # late workers send nothing
    # Every worker catches up: the replicas end on the servers' model, which is the replay's.
    assert summary["replicas_identical"]
    final, norms = replay(chosen)
    assert relative_error(load_params(job), final) <= TOL
    # The shards measured the noise scale's norms over the same two workers. A rank logs them when the
    # update it pulled was its step's: not when it sat the step out, nor when the others were a step
    # further on by its pull (a late rank's often are).
    for step, (local_sq, big_sq) in enumerate(norms):
        logged = [(log[step]["grad_sq_small"], log[step]["grad_sq_big"]) for log in logs
                  if log[step].get("grad_sq_small") is not None]
        assert logged and all(got == (pytest.approx(local_sq, rel=TOL), pytest.approx(big_sq, rel=TOL)) for got in logged)
    assert summary["noise_scale"]["b_big"] == 40  # the two workers' batches the updates took, not the three's


REFUSED = {
    ("sync=ps", "world_size=2", "sync.backup_workers=2"): "sync.backup_workers=2 with world_size=2",
    ("sync=ps", "world_size=3", "sync.backup_workers=1", "sync.mode=async"): "sync.mode=async: every push is applied on arrival",
    ("sync=ps", "world_size=3", "sync.backup_workers=1", "sync.mode=ssp"): "sync.mode=ssp: every push is applied on arrival",
    ("sync=ps", "world_size=3", "sync.backup_workers=1", "sync.servers=2", "sync.overlap=true"): "drop sync.overlap",
    ("sync=ps", "world_size=3", "sync.backup_workers=1", "compress=topk"): "compress=topk",
    ("sync=ps", "world_size=3", "sync.backup_workers=1", "checkpoint.every=2"): "drop checkpoint.every",
    ("sync=ring", "world_size=3", "sync.backup_workers=1"): "a collective waits for every rank's",
    ("sync=byteps", "world_size=3", "sync.backup_workers=1"): "backup_workers is an option of sync=ps",
}


@pytest.mark.unit
@pytest.mark.parametrize("args", list(REFUSED), ids=[" ".join(a) for a in REFUSED])
def test_backup_workers_are_refused_where_they_cannot_work(args: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(list(args))
    assert REFUSED[args] in str(info.value)
