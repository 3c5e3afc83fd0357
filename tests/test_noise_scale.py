"""The gradient noise scale (stats.noise_scale): McCandlish's two-batch estimator is unbiased where
the gradient's covariance is known in closed form, and a run logs the very norms it is fed."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from conftest import read_json, read_jsonl, run_cli
from hydra import compose, initialize_config_dir

from testbed.config import ConfigError
from testbed.data import build_data
from testbed.imbalance import shard_batches
from testbed.models import build_model, objective_batches
from testbed.models.call import model_call
from testbed.paths import config_dir
from testbed.preflight import check_command_line
from testbed.results.table import format_table, summary_row
from testbed.stats.noise_scale import NoiseScale, statistical_efficiency, two_batch


@pytest.mark.unit
def test_two_batch_estimates_are_unbiased_for_linear_regression() -> None:
    """y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, σ²), loss ½(x·w − y)²: at w = w* + r a sample's
    gradient x(xᵀr − ε) has mean G = r and covariance |r|² I + r rᵀ + σ² I, so |G|² = |r|² and
    tr(Σ) = (d + 1)|r|² + d σ² exactly. Ranks of 8 samples, four of them, many trials."""
    d, sigma, ranks, b, trials = 6, 0.5, 4, 8, 20000
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(d, generator=gen, dtype=torch.float64)
    grad_sq, trace = float(r @ r), (d + 1) * float(r @ r) + d * sigma**2
    x = torch.randn(trials, ranks, b, d, generator=gen, dtype=torch.float64)
    eps = sigma * torch.randn(trials, ranks, b, generator=gen, dtype=torch.float64)
    local = (x * ((x @ r) - eps).unsqueeze(-1)).mean(dim=2)  # each rank's mean gradient: trials × ranks × d
    small_sq = local.pow(2).sum(-1).mean(-1)  # the mean of the ranks' squared norms
    big_sq = local.mean(dim=1).pow(2).sum(-1)
    estimates = torch.tensor([two_batch(float(s), float(g), b, ranks * b) for s, g in zip(small_sq, big_sq)])
    mean, error = estimates.mean(0), estimates.std(0) / trials**0.5
    for got, err, want in zip(mean.tolist(), error.tolist(), (grad_sq, trace)):
        assert abs(got - want) <= 4 * err, (got, want, err)
    # The ratio of the averages is B_simple: tr(Σ)/|G|².
    scale = NoiseScale(ema=0.999)
    for g, t in estimates.tolist():
        scale.update(g, t)
    assert scale.b_simple() == pytest.approx(trace / grad_sq, rel=0.1)


@pytest.mark.unit
def test_statistical_efficiency_is_pollux_s() -> None:
    assert statistical_efficiency(100.0, 100.0, 100.0) == 1.0
    assert statistical_efficiency(100.0, 300.0, 100.0) == pytest.approx(0.5)  # past B_simple, samples count less
    assert statistical_efficiency(1e9, 300.0, 100.0) == pytest.approx(1.0)  # far below B_simple: every sample counts
    with pytest.raises(ValueError, match="B_small"):
        two_batch(1.0, 1.0, 8, 8)


RUN = ["world_size=2", "steps=6", "warmup_steps=1", "stats.noise_scale=true", "imbalance=uneven",
       "imbalance.skew=3", "data.batch_size=16", "data.num_samples=256", "data.shape=[24]", "model.hidden=32",
       "launcher.echo_rank0=false"]


def local_gradients_at_step_zero() -> tuple[list[torch.Tensor], list[int]]:
    """Each rank's mean gradient on its first batch, from the initial model, in this process."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*RUN, "sync=ring", "device=cpu"])
    sizes = shard_batches(cfg)
    grads = []
    for rank in range(cfg.world_size):
        spec, data = build_data(cfg.data, sizes, rank, cfg.seed, "cpu")
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, spec)
        model_call(cfg.model)(model, *objective_batches(cfg.model, data, spec, cfg.seed, rank).batch(0)).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).double())
    return grads, sizes


# A collective: the ranks measure, with one scalar all-reduce. Parameter servers: the shards measure,
# from the pushes, each its slice of the average (two shards: the slices add up).
@pytest.mark.parametrize("sync", [["sync=ring"], ["sync=ps", "sync.servers=2"]], ids=["ring", "ps"])
def test_a_run_logs_the_norms_of_the_local_and_averaged_gradients(tmp_path: Path, sync: list[str]) -> None:
    proc = run_cli([*RUN, *sync, f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [read_jsonl(tmp_path / "job" / "metrics" / f"rank{r}.jsonl") for r in range(2)]
    assert [[r["grad_sq_small"], r["grad_sq_big"]] for r in logs[0]] == [[r["grad_sq_small"], r["grad_sq_big"]]
                                                                         for r in logs[1]]
    grads, sizes = local_gradients_at_step_zero()
    assert sizes[0] != sizes[1]  # uneven: each rank's gradient is weighted by its samples in the average
    small = statistics.fmean(float(g @ g) for g in grads)
    mean = (sizes[0] * grads[0] + sizes[1] * grads[1]) / sum(sizes)
    assert logs[0][0]["grad_sq_small"] == pytest.approx(small, rel=1e-5)
    assert logs[0][0]["grad_sq_big"] == pytest.approx(float(mean @ mean), rel=1e-5)
    summary = read_json(tmp_path / "job" / "summary.json")
    noise = summary["noise_scale"]
    assert (noise["b_small"], noise["b_big"]) == (pytest.approx(statistics.harmonic_mean(sizes)), sum(sizes))
    assert noise["goodput"] == pytest.approx(summary["throughput"] * noise["statistical_efficiency"])
    efficiency = statistical_efficiency(noise["b_simple"], sum(sizes), noise["base_batch"])
    assert noise["statistical_efficiency"] == pytest.approx(efficiency)
    header, *_ = format_table([summary_row(summary)]).splitlines()
    assert "goodput" in header and "B_simple" in header


REFUSED = {
    ("stats.noise_scale=true",): "world_size >= 2",
    ("stats.noise_scale=true", "world_size=2", "sync=ddp"): "DDP averages the gradients inside backward",
    ("stats.noise_scale=true", "world_size=2", "sync=ps", "sync.mode=async"): "no update averages the workers' gradients",
    ("stats.noise_scale=true", "world_size=2", "sync=ps", "sync.mode=ssp"): "no update averages the workers' gradients",
    ("stats.noise_scale=true", "world_size=2", "sync=ps", "sync.servers=2", "sync.overlap=true"):
        "before a worker has its own gradient's norm",
    ("stats.noise_scale=true", "world_size=2", "sync=local_sgd"): "never a step's gradients",
    ("stats.noise_scale=true", "world_size=2", "sync=allreduce", "sync.overlap=true"): "drop sync.overlap",
    ("stats.ema=1.0",): "stats.ema=1.0",
}


@pytest.mark.unit
@pytest.mark.parametrize("args", list(REFUSED), ids=[" ".join(a) for a in REFUSED])
def test_the_noise_scale_is_refused_where_it_cannot_be_measured(args: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(list(args))
    assert REFUSED[args] in str(info.value)
