"""The critical batch's analysis (analysis.critical_batch) on runs whose steps to target follow
McCandlish's curve by construction, in process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import critical_batch

pytestmark = pytest.mark.unit

S_MIN, B_NOISE = 200.0, 64.0


def _runs(b_simple: float, noise: float = 0.05, reached: bool = True) -> pd.DataFrame:
    """Three seeds at global batches 8 to 512, steps S_MIN (1 + B_NOISE/B) times a seeded +-5 %, and
    one run of another learning rate that must not join the curve."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in (8, 16, 32, 64, 128, 256, 512):
        for seed in range(3):
            steps = S_MIN * (1 + B_NOISE / batch) * (1 + noise * rng.uniform(-1, 1))
            rows.append({"status": "ok", "option": "allreduce", "target_metric": "accuracy", "global_batch": batch,
                         "tta_reached": reached or batch > 8, "tta_steps": round(steps), "b_simple": b_simple,
                         "overrides": f"seed={seed},data.batch_size={batch // 2},world_size=2"})
    rows.append({**rows[0], "overrides": "optim.lr=0.1,seed=0,data.batch_size=4"})
    return pd.DataFrame(rows)


def test_the_fit_recovers_the_knee_with_an_interval_around_it() -> None:
    series = critical_batch.series(_runs(80.0))
    assert [name for name, _ in series] == ["allreduce"]  # the lr=0.1 run has one batch: no curve
    [(name, group)] = series
    table, fit = critical_batch.knee_table(group)
    assert name == "allreduce" and list(table["global_batch"]) == [8, 16, 32, 64, 128, 256, 512]
    assert list(table["runs"]) == [3] * 7 and fit["s_min"] == pytest.approx(S_MIN, rel=0.05)
    assert fit["b_noise"] == pytest.approx(B_NOISE, rel=0.1)
    assert fit["b_noise_lo"] < B_NOISE < fit["b_noise_hi"] and fit["b_noise_hi"] - fit["b_noise_lo"] < B_NOISE
    assert fit["ratio"] == pytest.approx(80.0 / fit["b_noise"])
    # B_simple's curve passes through the smallest batch's median and levels off at its own S_min.
    predicted = critical_batch.predicted_steps(table, 80.0, np.array([8.0, 1e9]))
    assert predicted[0] == pytest.approx(table["steps_median"].iloc[0])
    assert predicted[1] == pytest.approx(table["steps_median"].iloc[0] / (1 + 80.0 / 8))


def test_unreached_runs_are_counted_but_not_fitted_and_a_curve_without_a_knee_fits_none() -> None:
    [(_, group)] = [s for s in critical_batch.series(_runs(80.0, reached=False)) if s[0] == "allreduce"]
    table, fit = critical_batch.knee_table(group)
    assert table["reached"].iloc[0] == 0 and math.isnan(table["steps_median"].iloc[0])
    assert fit["b_noise"] == pytest.approx(B_NOISE, rel=0.15)
    # Steps that keep halving with every doubling (all batches far below the knee): no positive S_min.
    batches = np.array([8.0, 16, 32, 64])
    assert all(math.isnan(v) for v in critical_batch.fit_knee(batches, 1000 * 8 / batches - 10))
    # Steps that grow with the batch (a rate too large for it): no knee either.
    assert all(math.isnan(v) for v in critical_batch.fit_knee(batches, 100 + batches))


def test_the_section_names_the_verdict_and_draws_the_figure(tmp_path: Path) -> None:
    written, section = critical_batch.analyse(_runs(80.0), tmp_path)
    assert (tmp_path / "critical_batch.png").stat().st_size > 1000 and len(written) == 2
    assert "## The critical batch" in section and "within 2x of the knee" in section
    _, far = critical_batch.analyse(_runs(400.0), tmp_path)
    assert "more than 2x from the knee" in far
    # Runs with one batch only (any other sweep) draw nothing.
    assert critical_batch.analyse(_runs(80.0).query("global_batch == 64"), tmp_path) == ([], "")
