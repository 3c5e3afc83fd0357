"""launcher=virtual: the simulator's clock for a described cluster, the gradients real.

The synchronous families end at the real synchronizers' models (real runs through the CLI, virtual
ones in this process); the same seed gives a bitwise-equal virtual run; asynchronous staleness and
the slowest worker's wait follow from the clock as theory says; bad input is refused first.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, load_params, read_json, read_jsonl, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed import config
from testbed.cluster import FAMILIES
from testbed.data import build_data
from testbed.launch.virtual.cluster import pace
from testbed.launch.virtual.run import clock_config, run_virtual
from testbed.models import build_model
from testbed.models.call import model_call
from testbed.paths import config_dir
from testbed.sim.step import Compute, predict
from testbed.sync import SYNCHRONIZERS

COMMON = ["data=mnist1d", "model=mlp", "steps=12", "warmup_steps=2", "eval.at_end=false", "data.batch_size=16"]
# The clock's compute: given, so that a run does not time this machine (the clock is then deterministic).
FIXED = ["launcher=virtual", "cluster=here", "cluster.compute.ms_per_sample=0.05"]
TOL = 1e-6


def cfg_of(overrides: list[str]):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def virtual(tmp: Path, overrides: list[str]) -> dict:
    """A virtual run in this process, validated first as the CLI does."""
    cfg = cfg_of([*COMMON, *FIXED, *overrides])
    config.validate(cfg)
    tmp.mkdir(parents=True, exist_ok=True)
    return run_virtual(cfg, config.to_plain(cfg), tmp)


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    return num / sum(float((a[k] ** 2).sum()) for k in a) ** 0.5


# The real runs of each synchronous family, at n = 2 and 3: one sweep each. Local SGD with plain SGD:
# with momentum, the real synchronizer's rounding differs from a single-process replica's by an ulp,
# which a ReLU at its kink can grow to 1e-5 within a few steps (the virtual run matches the replica).
REAL = {
    "allreduce": ["sync=allreduce,ring"],
    "ps": ["sync=ps", "sync.servers=2", "optim=adamw"],
    "local_sgd": ["sync=local_sgd", "sync.period=2", "optim=sgd_plain"],
    "codecs": ["sync=ring", "compress=topk,powersgd", "compress.error_feedback=true"],
    # A parameter server's shards decode each worker's payload; random-k draws from the worker's pushes.
    # At n = 3 only: a compressed push's path is the same at any n, and each real PS run costs seconds.
    "ps_codecs": ["sync=ps", "sync.servers=2", "compress=randomk", "compress.error_feedback=true", "world_size=3"],
}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    jobs = {}
    for name, args in REAL.items():
        sweep = tmp_path_factory.mktemp(name)
        sizes = [] if any(a.startswith("world_size=") for a in args) else ["world_size=2,3"]
        done = run_cli(["-m", *COMMON, *args, *sizes, f"hydra.sweep.dir={sweep}"], REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        for summary in sweep.glob("*/summary.json"):
            s = read_json(summary)
            assert s["status"] == "ok", s["error"]
            codec = s["config"]["compress"]["name"]
            name = s["sync"] if codec == "none" else codec if s["sync"] == "ring" else f"{s['sync']}+{codec}"
            jobs[f"{name}-{s['world_size']}"] = summary.parent
    return jobs


# Each family's real sweep (REAL) and what picks it in that sweep.
CASES = {"allreduce": ("allreduce", ["sync=allreduce"]), "ring": ("allreduce", ["sync=ring"]),
         "ps": ("ps", ["sync=ps"]), "local_sgd": ("local_sgd", ["sync=local_sgd"]),
         "topk": ("codecs", ["sync=ring", "compress=topk"]), "powersgd": ("codecs", ["sync=ring", "compress=powersgd"]),
         "ps+randomk": ("ps_codecs", ["sync=ps", "compress=randomk"])}


@pytest.mark.parametrize(("family", "n"), [(family, n) for family in CASES for n in (2, 3)
                                           if (family, n) != ("ps+randomk", 2)])
def test_virtual_matches_the_real_synchronizer(real: dict[str, Path], tmp_path: Path, family: str, n: int) -> None:
    """The codecs run on ring and on a parameter server: every worker's real codecs, error feedback included."""
    sweep, chosen = CASES[family]
    args = [a for a in REAL[sweep] if not a.startswith(("sync=", "compress=", "world_size="))]
    summary = virtual(tmp_path, [*chosen, f"world_size={n}", *args])
    assert summary["status"] == "ok" and summary["clock"] == "simulated"
    assert rel_err(load_params(real[f"{family}-{n}"]), load_params(tmp_path)) <= TOL
    # The losses each worker recorded are the real ranks' (ulps apart at most).
    measured = read_jsonl(real[f"{family}-{n}"] / "metrics" / f"rank{n - 1}.jsonl")
    replayed = read_jsonl(tmp_path / "metrics" / f"rank{n - 1}.jsonl")
    assert [r["step"] for r in replayed] == [r["step"] for r in measured]
    assert np.allclose([r["loss"] for r in replayed], [r["loss"] for r in measured], rtol=1e-5)


def test_replaying_a_real_async_run_reproduces_its_model(tmp_path: Path) -> None:
    """The real run's step logs give its shard's order (version + staleness); replayed, the virtual
    run computes the same model and the same staleness histogram."""
    real = tmp_path / "real"
    done = run_cli([*COMMON, "steps=20", "sync=ps", "sync.mode=async", "world_size=3", f"hydra.run.dir={real}"], REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = virtual(tmp_path / "replay", ["steps=20", "sync=ps", "sync.mode=async", "world_size=3",
                                            f"launcher.replay={real}"])
    assert summary["cluster"]["order"] == f"replayed from {real}"
    assert rel_err(load_params(real), load_params(tmp_path / "replay")) <= TOL
    assert summary["staleness_histogram"] == read_json(real / "summary.json")["staleness_histogram"]
    with pytest.raises(config.ConfigError, match="one shard"):
        config.validate(cfg_of([*COMMON, *FIXED, "sync=ps", "sync.mode=async", "sync.servers=2", "world_size=3",
                                f"launcher.replay={real}"]))


def test_a_fixed_delay_computes_each_step_at_the_parameters_of_s_steps_before(tmp_path: Path) -> None:
    delay, steps = 2, 6
    args = ["sync=allreduce", "world_size=1", "optim=sgd_plain", f"steps={steps}", f"launcher.fixed_delay={delay}"]
    summary = virtual(tmp_path, args)
    assert summary["staleness_histogram"] == [1, 1, steps - 2]  # steps 0 and 1 at the initial parameters
    cfg = cfg_of([*COMMON, *FIXED, *args])
    torch.manual_seed(0)
    spec, data = build_data(cfg.data, [int(cfg.data.batch_size)], 0, 0)
    model = build_model(cfg.model, spec)
    history = [torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()]
    for step in range(steps):
        torch.nn.utils.vector_to_parameters(history[max(0, step - delay)], model.parameters())
        model.zero_grad()
        model_call(cfg.model)(model, *data.batch(step)).loss.backward()
        grad = torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters())
        history.append(history[-1] - float(cfg.optim.lr) * grad)
    torch.nn.utils.vector_to_parameters(history[-1], model.parameters())
    assert rel_err(model.state_dict(), load_params(tmp_path)) <= TOL
    with pytest.raises(config.ConfigError, match="fixed_delay"):
        config.validate(cfg_of([*COMMON, *FIXED, "sync=ps", "launcher.fixed_delay=1"]))


def test_same_seed_same_virtual_run_bitwise(tmp_path: Path) -> None:
    args = ["sync=ps", "sync.mode=ssp", "sync.staleness=1", "world_size=5", "cluster.compute.distribution=lognormal",
            "eval.every=4"]
    first, second = virtual(tmp_path / "a", args), virtual(tmp_path / "b", args)
    for name in ("rank0.jsonl", "rank4.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / "metrics" / name).read_text() == (tmp_path / "b" / "metrics" / name).read_text()
    a, b = load_params(tmp_path / "a"), load_params(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert first["staleness_histogram"] == second["staleness_histogram"]
    assert first["time_to_target"] is None and first["eval"]["evaluations"] == 3
    # SSP's bound holds: no push is more than (staleness + 1) (n - 1) versions stale.
    assert len(first["staleness_histogram"]) - 1 <= 2 * 4


@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_balanced_batches_move_samples_to_the_fast_workers_and_keep_the_model(tmp_path: Path, sync: str) -> None:
    # Worker 1 computes at a third of the others' speed; balance decides the shares after step 1.
    args = [f"sync={sync}", "world_size=3", "cluster.compute.stragglers=[1]", "cluster.compute.slowdown=3"]
    virtual(tmp_path / "even", args)
    virtual(tmp_path / "balanced", [*args, "balance=static", "balance.every=2"])
    logs = {run: [read_jsonl(tmp_path / run / "metrics" / f"rank{w}.jsonl") for w in range(3)]
            for run in ("even", "balanced")}
    shares = [row["samples"] for row in (logs["balanced"][w][-1] for w in range(3))]
    assert shares == [21, 7, 20], shares  # 48 samples at speeds 3 : 1 : 3, largest remainders first
    assert [logs["balanced"][w][1]["samples"] for w in range(3)] == [16, 16, 16]
    step_s = {run: sum(row["t_step"] for row in rows[0][2:]) for run, rows in logs.items()}
    assert step_s["balanced"] < 0.8 * step_s["even"], step_s  # 0.54 (allreduce), 0.74 (ps)
    # Every step still trains on the same global batch, so the model is the same.
    assert rel_err(load_params(tmp_path / "even"), load_params(tmp_path / "balanced")) <= TOL


@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_a_lost_worker_and_its_newcomer_keep_the_model_and_charge_the_clock(tmp_path: Path, sync: str) -> None:
    # Four workers, a global batch of 48; worker 2 is lost at the start of step 5 and a newcomer, ready
    # at once, takes its place at step 8. The all-reduce family commits every 2 steps, so it resumes at
    # step 4; the servers hold the model and resume at 5.
    elastic = [f"sync={sync}", "world_size=4", "data.batch_size=12", "elastic.enabled=true", "elastic.min_workers=3",
               "elastic.commit_every=2", "cluster.membership.start_s=0"]
    virtual(tmp_path / "whole", elastic)
    summary = virtual(tmp_path / "lost", [*elastic, "fault=kill_rank", "fault.rank=2", "fault.step=5",
                                          "elastic.rejoin_step=8"])
    # The same global batch every step, split among whoever is there: the model of the run without a loss.
    assert rel_err(load_params(tmp_path / "whole"), load_params(tmp_path / "lost")) <= TOL
    resume = 5 if sync == "ps" else 4
    start, lost, joined = summary["membership"]
    assert (start["members"], lost["members"], joined["members"]) == ([0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3])
    assert (lost["step"], lost["lost"], lost["interrupted_step"], lost["rolled_back_steps"]) == (resume, [2], 5, 5 - resume)
    assert (joined["step"], joined["joined"]) == (8, [2])
    logs = {run: [read_jsonl(tmp_path / run / "metrics" / f"rank{w}.jsonl") for w in range(4)] for run in ("whole", "lost")}
    assert [row["step"] for row in logs["lost"][2]] == [*range(5), *range(8, 12)]  # the steps it completed
    assert [row["samples"] for row in logs["lost"][0]] == [12] * resume + [16] * (8 - resume) + [12] * 4
    # The change's cost lands in the first step after it: the regroup (40 ms) and the join (150 ms).
    extra = [logs["lost"][0][step]["t_step"] - logs["whole"][0][step]["t_step"] for step in (resume, 8)]
    assert extra[0] >= 0.040 and extra[1] >= 0.150, extra
    assert lost["downtime_s"] >= 0.040 and joined["downtime_s"] >= 0.150


def test_a_newcomer_joins_once_ready_or_is_waited_for(tmp_path: Path) -> None:
    lost = ["sync=ring", "world_size=4", "data.batch_size=12", "elastic.enabled=true", "elastic.min_workers=3",
            "fault=kill_rank", "fault.rank=2", "fault.step=3", "elastic.rejoin_step=5", "cluster.membership.start_s=1"]
    # Steps of a few milliseconds: a newcomer ready a second after the loss comes after the run's end ...
    assert len(virtual(tmp_path / "late", lost)["membership"]) == 2
    # ... unless the members wait for it at rejoin_step, for the rest of that second.
    joined = virtual(tmp_path / "waited", [*lost, "elastic.rejoin_wait=true"])["membership"][2]
    assert joined["step"] == 5 and 0.9 < joined["downtime_s"] < 1.2, joined


def test_calibrated_links_are_this_machines_fits_for_each_synchronizer(tmp_path: Path) -> None:
    nominal = virtual(tmp_path / "nominal", ["sync=ps", "world_size=2"])
    measured = virtual(tmp_path / "measured", ["sync=ps", "world_size=2", "cluster.calibration=docs/sim/calibration.json"])
    assert nominal["sync_facts"]["link"]["source"] == "nominal"
    link = measured["sync_facts"]["link"]
    assert (link["source"], link["link"], link["impl"]) == ("calibration", "loopback", "ps_k1")
    # gRPC's per-message cost on loopback (about 3.7 ms a push or pull) against the nominal 50 us.
    assert measured["step_time"] > nominal["step_time"] + 2 * link["alpha"]


@pytest.mark.parametrize("distribution", ["constant", "lognormal"])
def test_async_staleness_of_n_equal_workers_averages_n_minus_1(tmp_path: Path, distribution: str) -> None:
    n = 8
    summary = virtual(tmp_path, ["sync=ps", "sync.mode=async", f"world_size={n}", "steps=20",
                                 f"cluster.compute.distribution={distribution}", "cluster.compute.sigma=0.3"])
    histogram = summary["staleness_histogram"]
    mean = sum(s * c for s, c in enumerate(histogram)) / sum(histogram)
    assert abs(mean - (n - 1)) <= 0.3 * (n - 1), histogram
    assert summary["sync_facts"]["server_staleness_histogram"] == histogram  # the shards' own count


def test_slowest_of_n_exponential_workers_waits_the_harmonic_number() -> None:
    """A synchronous step waits for the slowest of n workers: with exponential compute of mean c
    (and a free network), its mean is c H_n."""
    steps, c = 3000, 1e-3
    for n in (1, 2, 4, 16):
        cfg = clock_config(cfg_of([*COMMON, *FIXED, "sync=allreduce", f"world_size={n}", f"steps={steps}",
                                   "cluster.compute.distribution=exponential", "cluster.bandwidth=1000000gbit",
                                   "cluster.alpha_us=0", "data.batch_size=1"]))
        paced = pace(cfg.cluster.compute, n, steps, seed=0)
        records = predict(cfg, Compute(c * 0.33, c * 0.67, 0.0, 0.0), paced).records
        mean = np.mean([max(r[t].t_step for r in records) for t in range(steps)])
        harmonic = sum(1 / k for k in range(1, n + 1))
        assert mean == pytest.approx(c * harmonic, rel=0.04), n


def test_a_workers_draws_do_not_depend_on_the_others() -> None:
    compute = OmegaConf.create({"distribution": "pareto", "shape": 2.5, "sigma": 0.5, "stragglers": [1], "slowdown": 3.0})
    four, five = pace(compute, 4, 50, seed=7), pace(compute, 5, 50, seed=7)
    assert np.array_equal(four, five[:, :4])
    assert abs(pace(compute, 64, 4000, seed=1)[:, 2:].mean() - 1.0) < 0.05  # mean 1 (pareto's tail: loose)


@pytest.mark.parametrize(("overrides", "named"), [
    (["sync=zero"], "launcher=virtual runs sync="),
    (["sync=ps", "compress=topk", "compress.pull=true", "eval.every=0"], "compress.pull"),
    (["sync=local_sgd", "balance=static"], "balance=static with sync=local_sgd"),
    (["cluster.compute.ms_per_sample=-1"], "cluster.compute.ms_per_sample=-1"),
    (["cluster.compute.distribution=weibull"], "cluster.compute.distribution=weibull"),
    (["cluster.compute.stragglers=[9]"], "cluster.compute.stragglers"),
    (["world_size=5000"], "more workers than the 4000 training samples"),
    (["model=gpt2", "data=lm", "model.n_layer=1", "model.d_model=32", "model.n_head=2"], "its dropout"),
    (["cluster.compute.wobble=1"], None),
    (["cluster.bandwidth=fast"], "cluster.bandwidth=fast"),
    (["cluster.calibration=nowhere.json"], "cluster.calibration=nowhere.json"),
    (["fault=kill_rank", "world_size=2"], "fault=kill_rank with elastic.enabled=true"),
    (["sync=ps", "sync.mode=async", "elastic.enabled=true", "world_size=2"], "elastic.enabled and sync.mode=async"),
    (["elastic.enabled=true", "world_size=2", "elastic.batch=keep_local", "optim.lr_scaling=none"], "elastic.batch=keep_local"),
    (["cluster.membership.regroup_ms=-1"], "cluster.membership.regroup_ms=-1"),
    (["cluster.server_link=lifo"], "cluster.server_link=lifo: allowed: fair|fifo"),
])
def test_bad_virtual_input_is_refused_before_anything_runs(overrides: list[str], named: str | None) -> None:
    try:
        cfg = cfg_of([*COMMON, *FIXED, *overrides])
    except Exception as exc:  # a key the schema does not have: refused at composition, as by the CLI
        assert named is None, exc
        return
    with pytest.raises(config.ConfigError) as refused:
        config.validate(cfg)
    assert named is not None and named in str(refused.value)


def test_a_cluster_without_the_virtual_launcher_is_refused_and_the_other_way_round() -> None:
    with pytest.raises(config.ConfigError, match="add launcher=virtual"):
        config.validate(cfg_of([*COMMON, "cluster=gpu"]))
    with pytest.raises(config.ConfigError, match="launcher=virtual needs a cluster"):
        config.validate(cfg_of([*COMMON, "launcher=virtual"]))


def test_every_virtual_family_names_a_synchronizer() -> None:
    assert set(FAMILIES) <= set(SYNCHRONIZERS)


def test_cli_writes_the_results_contract_on_the_simulated_clock(tmp_path: Path) -> None:
    """One job through the CLI on the GPU preset: step logs per worker, eval.jsonl with the target,
    summary.json naming its clock and cluster; backup workers drop the late gradients."""
    done = run_cli([*COMMON, "launcher=virtual", "cluster=gpu", "sync=ps", "sync.backup_workers=1", "world_size=6",
                    "eval.every=6", "target.metric=accuracy", "target.value=0.05", f"hydra.run.dir={tmp_path}"], REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_json(tmp_path / "summary.json")
    assert summary["clock"] == "simulated" and summary["cluster"]["name"] == "gpu"
    assert summary["cluster"]["compute_from"] == "model FLOPs at cluster.compute.flops_per_s"
    assert summary["time_to_target"]["reached"] and summary["time_to_target"]["seconds"] > 0
    assert sum(summary["backup"]["dropped"]) + sum(summary["backup"]["sat_out"]) >= 12  # one of six, every step
    assert len(list((tmp_path / "metrics").glob("rank*.jsonl"))) == 6
    # The first evaluation waits for the slowest worker's sixth step, and is charged to the clock.
    rows = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    ends = [sum(r["t_step"] for r in read_jsonl(tmp_path / "metrics" / f"rank{w}.jsonl")[:6]) for w in range(6)]
    assert rows[0]["time_s"] == pytest.approx(max(ends) + rows[0]["t_eval"], rel=1e-9)
    assert rows[0]["t_eval"] > 0 and not math.isnan(summary["final_loss"])


def test_a_diverged_run_stops_at_its_first_non_finite_evaluation(tmp_path: Path) -> None:
    summary = virtual(tmp_path, ["sync=allreduce", "world_size=2", "optim.lr=1e6", "steps=40", "eval.every=2",
                                 "target.metric=accuracy", "target.value=0.9", "target.stop=true"])
    assert summary["time_to_target"]["status"] == "diverged" and not summary["time_to_target"]["reached"]
    rows = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert not math.isfinite(rows[-1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[:-1])
    assert rows[-1]["step"] < 39
