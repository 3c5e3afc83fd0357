"""Load imbalance: seeded injected delays, uneven shards that keep training exact, and stragglers
that show up where they should (step time, imbalance, the fast rank's wait), real runs throughout."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli
from omegaconf import OmegaConf

from testbed.data import RankBatches
from testbed.imbalance import Injector, loss_weight, shard_batches
from testbed.sim.events import simulate_ps


def jitter(distribution: str, std_ms: float | None = 4.0, ranks: list[int] | None = None) -> OmegaConf:
    return OmegaConf.create(
        {"name": "jitter", "distribution": distribution, "mean_ms": 8.0, "std_ms": std_ms, "ranks": ranks}
    )


@pytest.mark.parametrize("distribution,std_ms", [("normal", 4.0), ("lognormal", 4.0), ("exponential", None)])
def test_jitter_is_seeded_and_has_the_configured_moments(distribution: str, std_ms: float | None) -> None:
    cfg = jitter(distribution, std_ms)
    draws = [Injector(cfg, rank=1, seed=7).delay_s(None) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # a fresh injector with the same seed draws the same
    same = Injector(cfg, rank=1, seed=7)
    other_seed, other_rank = Injector(cfg, 1, seed=8), Injector(cfg, 0, seed=7)
    series = [same.delay_s(None) for _ in range(20_000)]
    assert series[:50] != [other_seed.delay_s(None) for _ in range(50)]
    assert series[:50] != [other_rank.delay_s(None) for _ in range(50)]
    assert min(series) >= 0.0
    mean, std = statistics.fmean(series), statistics.pstdev(series)
    expected_std = (std_ms or 8.0) / 1e3
    if distribution != "normal":  # the normal is clipped at 0, which shifts its moments a little
        assert mean == pytest.approx(8e-3, rel=0.05)
        assert std == pytest.approx(expected_std, rel=0.08)


def test_jitter_only_on_chosen_ranks() -> None:
    chosen = Injector(jitter("lognormal", ranks=[1]), rank=1, seed=3)
    spared = Injector(jitter("lognormal", ranks=[1]), rank=0, seed=3)
    assert [spared.delay_s(None) for _ in range(10)] == [0.0] * 10
    assert all(chosen.delay_s(None) > 0 for _ in range(10))


def test_straggler_and_heterogeneous_scale_the_measured_compute() -> None:
    straggler = OmegaConf.create({"name": "straggler", "ranks": [1], "slowdown": 1.0, "delay_ms": 5.0})
    assert Injector(straggler, 1, 0).delay_s(0.02) == pytest.approx(0.025)
    assert Injector(straggler, 1, 0).delay_s(None) == pytest.approx(0.005)  # no measurement yet
    assert Injector(straggler, 0, 0).delay_s(0.02) == 0.0
    hetero = OmegaConf.create({"name": "heterogeneous", "speeds": [1.0, 0.25]})
    assert Injector(hetero, 1, 0).delay_s(0.01) == pytest.approx(0.03)
    assert Injector(hetero, 2, 0).delay_s(0.01) == 0.0  # beyond the list: full speed


def uneven_cfg(n: int, batch: int, **imbalance: object) -> OmegaConf:
    return OmegaConf.create({
        "world_size": n, "data": {"batch_size": batch, "scaling": "weak"},
        "imbalance": {"name": "uneven", "skew": 2.0, "shares": [], **imbalance},
    })


def test_uneven_shards_keep_the_global_batch_and_its_samples() -> None:
    sizes = shard_batches(uneven_cfg(3, 10, skew=4.0))
    assert sum(sizes) == 30 and sizes == sorted(sizes) and sizes[-1] >= 3 * sizes[0]
    assert shard_batches(uneven_cfg(3, 10, shares=[1, 1, 8])) == [3, 3, 24]
    assert shard_batches(uneven_cfg(4, 1, skew=100.0)) == [1, 1, 1, 1]  # everyone keeps one sample
    # mean_r(w_r * mean loss over b_r) = sum of all losses / 30 when w_r = 3 * b_r / 30
    assert [loss_weight(sizes, r) for r in range(3)] == pytest.approx([3 * b / 30 for b in sizes])
    x, y = torch.arange(50).float().unsqueeze(1), torch.arange(50)
    single = RankBatches(x, y, [30], rank=0, seed=1)
    shards = [RankBatches(x, y, sizes, rank=r, seed=1) for r in range(3)]
    for step in range(6):
        assert torch.equal(torch.cat([s.indices(step) for s in shards]), single.indices(step))


COMMON = [
    "steps=6", "warmup_steps=1", "data.scaling=strong", "data.batch_size=12", "data.num_samples=40",
    "data.shape=[24]", "model.hidden=32", "launcher.echo_rank0=false",
]


@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_uneven_shards_train_the_single_process_model(tmp_path: Path, sync: str) -> None:
    ref, job = tmp_path / "ref", tmp_path / "job"
    assert run_cli(["sync=none", *COMMON, f"hydra.run.dir={ref}"], cwd=tmp_path).returncode == 0
    proc = run_cli([f"sync={sync}", "world_size=3", "imbalance=uneven", "imbalance.skew=3", *COMMON,
                    f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [read_jsonl(job / "metrics" / f"rank{r}.jsonl")[0]["samples"] for r in range(3)]
    assert sum(samples) == 12 and samples[0] < samples[2]
    assert read_json(job / "summary.json")["replicas_identical"]
    assert relative_error(load_params(job), load_params(ref)) <= 1e-5


# Compute of tens of milliseconds against a small gradient (1 MB): an injected +100 % stands out of
# the scheduling noise, and the transfer a straggler can hide (peers send eagerly into its socket
# buffers while it is late) is small.
SLOW = ["model.hidden=256", "data.shape=[512]", "data.batch_size=1024", "data.num_samples=2048",
        "steps=30", "warmup_steps=5", "launcher.echo_rank0=false", "threads_per_rank=1"]


def run(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / name
    proc = run_cli([*SLOW, "world_size=2", *args, f"hydra.run.dir={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out / "summary.json")


def rank_steps(job: Path, rank: int, warmup: int = 5) -> list[float]:
    return [r["t_step"] for r in read_jsonl(job / "metrics" / f"rank{rank}.jsonl")[warmup:]]


@pytest.mark.serial
def test_a_straggler_slows_the_synchronous_step_and_shows_in_the_metrics(tmp_path: Path) -> None:
    base = run(tmp_path, "base", "sync=allreduce")
    slow = run(tmp_path, "slow", "sync=allreduce", "imbalance=straggler", "imbalance.ranks=[1]", "imbalance.slowdown=1.0")
    injected = slow["per_rank"][1]["injected"]
    assert slow["per_rank"][0]["injected"] < 0.1 * injected  # only rank 1 was slowed
    assert injected == pytest.approx(slow["per_rank"][1]["compute"] - injected, rel=0.5)  # +100 % of compute
    # The step grows by about the injected time, and the fast rank spends it waiting.
    assert slow["step_time"] - base["step_time"] == pytest.approx(injected, rel=0.5)
    assert slow["per_rank"][0]["wait"] >= 0.5 * injected
    assert slow["per_rank"][1]["wait"] < 0.2 * injected
    assert slow["imbalance"] >= 0.2 > base["imbalance"]  # +100 % on one of two ranks: 2 / 1.5 - 1 = 0.33
    assert slow["slowest_ranks"][0]["rank"] == 1 and slow["slowest_ranks"][0]["share"] >= 0.9
    assert slow["idle_fraction"] > base["idle_fraction"]


@pytest.mark.serial
def test_async_ps_spares_the_fast_rank_from_a_straggler(tmp_path: Path) -> None:
    straggler = ["imbalance=straggler", "imbalance.ranks=[1]", "imbalance.delay_ms=40"]
    sync = run(tmp_path, "sync", "sync=ps", "sync.mode=sync", *straggler)
    asynchronous = run(tmp_path, "async", "sync=ps", "sync.mode=async", *straggler)
    assert sync["status"] == asynchronous["status"] == "ok"
    fast_sync = statistics.median(rank_steps(tmp_path / "sync", 0))
    fast_async = statistics.median(rank_steps(tmp_path / "async", 0))
    assert fast_sync - fast_async >= 0.6 * 0.040  # in BSP the fast rank absorbs the whole delay


@pytest.mark.serial
def test_ssp_absorbs_jitter_that_bsp_waits_for(tmp_path: Path) -> None:
    # Exponential delays on both ranks: in BSP every pull waits for the later of the two pushes
    # (E[max - min] = the mean, 30 ms); with bounded staleness a rank that drew a short delay goes
    # on, and pulls are held back only when it is 4 clocks ahead. How much SSP spares depends on the
    # draws (a random walk of the ranks' lead), so each run is checked against what either rule makes
    # of its own measured work times, replayed by the simulator's server without transfer costs.
    noise = ["imbalance=jitter", "imbalance.distribution=exponential", "imbalance.mean_ms=30", "imbalance.std_ms=null"]
    run(tmp_path, "bsp", "sync=ps", "sync.mode=sync", *noise)
    run(tmp_path, "ssp", "sync=ps", "sync.mode=ssp", "sync.staleness=4", *noise)

    def held(job: str) -> tuple[float, dict[str, float]]:
        """The mean time the server held a pull back, measured and as each rule would have it."""
        rows = [read_jsonl(tmp_path / job / "metrics" / f"rank{rank}.jsonl") for rank in range(2)]
        work = np.array([[r["t_step"] - r["t_wait"] for r in rank] for rank in rows]).T  # [steps, ranks]
        rule = {mode: float(simulate_ps(work, push_s=0, pull_s=0, server_in_s=0, server_out_s=0, mode=mode,
                                        staleness=4).wait_s[5:].mean()) for mode in ("sync", "ssp")}
        return statistics.fmean(r["t_wait"] for rank in rows for r in rank[5:]), rule

    for job, mode in (("bsp", "sync"), ("ssp", "ssp")):
        measured, rule = held(job)
        spared = rule["sync"] - rule["ssp"]
        assert rule["sync"] >= 0.25 * 0.030 and spared >= 0.1 * rule["sync"], rule  # the draws leave something to spare
        assert measured == pytest.approx(rule[mode], abs=0.25 * spared + 1e-3), (job, measured, rule)
