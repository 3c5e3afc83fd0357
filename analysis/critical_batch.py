"""The critical batch size: steps to the held-out target against the global batch, and the gradient
noise scale's prediction of it (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

Their model: the steps S and samples E = S·B to a target obey S = S_min (1 + B_noise/B), so doubling
a batch far below B_noise halves the steps, and far above it changes nothing. B_noise, the knee, is
the critical batch. It is fitted here by least squares of S on 1/B over every run that reached the
target (S = S_min + S_min B_noise · 1/B), with a 95 % bootstrap interval (the runs resampled within
each batch). B_simple, which the runs estimated as they trained (testbed.stats.noise_scale), predicts
the same curve with B_simple for B_noise; the prediction is anchored at the smallest batch's median
steps, so it uses nothing of the fit. McCandlish report B_simple within a small factor of B_noise.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.stats import point  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402
from testbed.results.keys import run_key  # noqa: E402

# A knee needs steps measured on both sides of it: at least this many distinct global batches.
MIN_BATCHES = 3
RESAMPLES = 2000
# What a series is: the run's overrides without the batch, the workers and the seed.
_BATCH_KEYS = ("data.batch_size=", "world_size=", "seed=", "+experiment=", "launcher.", "hydra.", "wandb.")


def fit_knee(batches: np.ndarray, steps: np.ndarray) -> tuple[float, float]:
    """(S_min, B_noise) of S = S_min (1 + B_noise/B) by least squares of S on 1/B; NaN where the
    fit has no positive S_min (the steps did not level off: every batch is below the knee) or no
    positive B_noise (the steps grew with the batch: the training broke down, not the model's knee)."""
    slope, intercept = np.polyfit(1.0 / batches, steps, 1)
    if intercept <= 0 or slope <= 0:
        return math.nan, math.nan
    return float(intercept), float(slope / intercept)


def _bootstrap(batches: np.ndarray, steps: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """The 95 % percentile interval of B_noise, resampling the runs within each batch."""
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(batches == b) for b in np.unique(batches)]
    knees = []
    for _ in range(RESAMPLES):
        pick = np.concatenate([rng.choice(g, size=len(g)) for g in groups])
        knees.append(fit_knee(batches[pick], steps[pick])[1])
    knees = np.array(knees)
    knees = knees[np.isfinite(knees)]
    if len(knees) < RESAMPLES // 2:
        return math.nan, math.nan
    return float(np.percentile(knees, 2.5)), float(np.percentile(knees, 97.5))


def series(runs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Groups of successful runs with a held-out target that differ only in batch, workers and seed,
    measured at MIN_BATCHES global batches or more: each one curve of steps against the batch."""
    ok = runs[(runs["status"] == "ok") & runs["target_metric"].notna() & runs["global_batch"].notna()].copy()
    if ok.empty:
        return []
    ok["curve"] = [f"{option} {run_key(o.split(',') if o else [], ignore=_BATCH_KEYS)}".strip()
                   for option, o in zip(ok["option"], ok["overrides"].fillna(""))]
    return [(name, g) for name, g in ok.groupby("curve") if g["global_batch"].nunique() >= MIN_BATCHES]


def knee_table(group: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per global batch: runs, reached, steps to target (median, interval), samples to target and
    B_simple (medians); and the fit: S_min, B_noise with its interval, B_simple over the runs, and
    their ratio. A run that did not reach the target has no steps and is left out of the fit."""
    rows = []
    for batch, g in group.groupby("global_batch"):
        reached = g[g["tta_reached"]]
        spread = point(list(reached["tta_steps"].astype(float)))
        rows.append({"global_batch": int(batch), "runs": len(g), "reached": len(reached),
                     "steps_median": spread["median"], "steps_lo": spread["lo"], "steps_hi": spread["hi"],
                     "samples_median": spread["median"] * batch,
                     "b_simple": g["b_simple"].median() if "b_simple" in g else math.nan})
    table = pd.DataFrame(rows).sort_values("global_batch").reset_index(drop=True)
    reached = group[group["tta_reached"]]
    batches, steps = reached["global_batch"].to_numpy(float), reached["tta_steps"].to_numpy(float)
    fit = {"s_min": math.nan, "b_noise": math.nan, "b_noise_lo": math.nan, "b_noise_hi": math.nan}
    if len(np.unique(batches)) >= MIN_BATCHES:
        fit["s_min"], fit["b_noise"] = fit_knee(batches, steps)
        fit["b_noise_lo"], fit["b_noise_hi"] = _bootstrap(batches, steps)
    b_simple = group["b_simple"].dropna() if "b_simple" in group else pd.Series(dtype=float)
    fit["b_simple"] = float(b_simple.median()) if not b_simple.empty else math.nan
    fit["ratio"] = fit["b_simple"] / fit["b_noise"] if fit["b_noise"] > 0 else math.nan
    return table, fit


def predicted_steps(table: pd.DataFrame, b_simple: float, batches: np.ndarray) -> np.ndarray:
    """B_simple's curve S_min (1 + B_simple/B), anchored at the smallest batch's median steps."""
    anchor = table.dropna(subset=["steps_median"]).iloc[0]
    s_min = anchor["steps_median"] / (1 + b_simple / anchor["global_batch"])
    return s_min * (1 + b_simple / batches)


def figure(curves: list[tuple[str, pd.DataFrame, dict[str, float]]], out: Path) -> list[Path]:
    """Steps and samples to target against the global batch: measured (median, 95 % interval), the
    fitted knee and B_simple's prediction."""
    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, table, fit) in enumerate(curves):
        color = f"C{i % 10}"
        t = table.dropna(subset=["steps_median"])
        low = (t["steps_median"] - t["steps_lo"]).clip(lower=0).fillna(0)
        high = (t["steps_hi"] - t["steps_median"]).clip(lower=0).fillna(0)
        ax_s.errorbar(t["global_batch"], t["steps_median"], yerr=[low, high], capsize=3, marker="o", ls="none",
                      color=color, label=f"{name}: measured")
        ax_e.plot(t["global_batch"], t["samples_median"], marker="o", ls="none", color=color)
        grid = np.geomspace(t["global_batch"].min(), t["global_batch"].max(), 100)
        if math.isfinite(fit["b_noise"]):
            fitted = fit["s_min"] * (1 + fit["b_noise"] / grid)
            ax_s.plot(grid, fitted, color=color, label=f"fit: B_noise = {fit['b_noise']:.0f}")
            ax_e.plot(grid, fitted * grid, color=color)
            ax_s.axvline(fit["b_noise"], color=color, lw=0.8)
        if math.isfinite(fit["b_simple"]):
            predicted = predicted_steps(t, fit["b_simple"], grid)
            ax_s.plot(grid, predicted, color=color, ls="--", label=f"B_simple's prediction: B_simple = {fit['b_simple']:.0f}")
            ax_e.plot(grid, predicted * grid, color=color, ls="--")
            ax_s.axvline(fit["b_simple"], color=color, lw=0.8, ls="--")
    for ax in (ax_s, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch B")
    ax_s.set_ylabel("steps to target")
    ax_e.set_ylabel("samples to target")
    ax_s.set_title("steps: halve with B below the knee, flat above")
    ax_e.set_title("samples: flat below the knee, grow above")
    ax_s.legend(fontsize=6, loc="upper right")
    return _save(fig, out, "critical_batch")


COLUMNS = {"global_batch": "global batch", "runs": "runs", "reached": "reached", "steps_median": "steps (median)",
           "steps_lo": "95 % lo", "steps_hi": "95 % hi", "samples_median": "samples", "b_simple": "B_simple"}


def analyse(runs: pd.DataFrame, out: Path) -> tuple[list[Path], str]:
    """The figure and report section of the critical batch; nothing unless some series of runs
    reached a held-out target at MIN_BATCHES global batches or more."""
    if "target_metric" not in runs.columns:
        return [], ""
    curves, parts = [], []
    for name, group in series(runs):
        table, fit = knee_table(group)
        curves.append((name, table, fit))
        if not math.isfinite(fit["b_noise"]):
            knee = ("No knee fitted: the steps to target do not fall as S_min (1 + B_noise/B) with positive S_min "
                    "and B_noise (they keep halving, or they grow with the batch).")
        else:
            knee = (f"Fit S = S_min (1 + B_noise/B): S_min = {fit['s_min']:.0f} steps, B_noise = {fit['b_noise']:.1f} "
                    f"(95 % bootstrap interval {fit['b_noise_lo']:.0f} to {fit['b_noise_hi']:.0f}).")
        if not math.isfinite(fit["b_simple"]):
            simple = "B_simple was not measured (stats.noise_scale)."
        elif math.isfinite(fit["ratio"]):
            close = "within 2x of the knee" if 0.5 <= fit["ratio"] <= 2 else "more than 2x from the knee"
            simple = f"B_simple (median over the runs) = {fit['b_simple']:.1f}: {fit['ratio']:.3f}x B_noise, {close}."
        else:
            simple = f"B_simple (median over the runs) = {fit['b_simple']:.1f}."
        parts += [f"### {name}", "", markdown_table(table, COLUMNS), "", f"{knee} {simple}", ""]
    if not curves:
        return [], ""
    intro = ["## The critical batch", "",
             "Steps to the held-out target against the global batch (median over the repeats that reached it, "
             "95 % t interval). The knee B_noise is fitted by least squares of S = S_min (1 + B_noise/B) over every "
             "run that reached the target, its interval by resampling the runs within each batch. B_simple's "
             "prediction is S_min (1 + B_simple/B) anchored at the smallest batch (McCandlish et al. 2018).", ""]
    return figure(curves, out), "\n".join(intro + parts)
