"""Scaling metrics over the run frame (analysis.load), repeats averaged with their spread.

For a configuration (the job's overrides but world_size and seed) with throughput X(n):
- speed-up S(n) = X(n) / X(1), X(1) the mean of that configuration's single-worker runs;
- scaling efficiency E(n) = S(n) / n;
- marginal speed-up (S(n) - S(m)) / (n - m) per worker added since the next smaller n = m
  (diminishing returns: where it falls toward 0, adding workers stops paying);
- ``efficiency_common``: against the fastest single-worker run of the same setting under any
  synchronizer, so that synchronizers whose own n = 1 run pays for communication (a parameter
  server round trip) are measured against the same baseline as everyone else.
"""

from __future__ import annotations

import pandas as pd

from analysis.load import QUIET
from analysis.stats import point, verdicts
from testbed.results.keys import run_key

MEASURES = ("throughput", "step_time", "imbalance", "idle_fraction")
# Measures against a swept override (figures 4-7), where the runs have them.
VERSUS = ("step_time", "throughput", "idle_fraction", "time_to_target", "eval_accuracy")


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, world_size): means and standard deviations over repeats."""
    ok = runs[runs["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    keys = ["config_key", "setting_key", "option", "setting", "world_size"]
    grouped = ok.groupby(keys, dropna=False)
    table = grouped[list(MEASURES)].mean()
    table["throughput_std"] = grouped["throughput"].std().fillna(0.0)
    table["step_time_std"] = grouped["step_time"].std().fillna(0.0)
    table["repeats"] = grouped.size()
    spread = grouped["throughput"].apply(lambda v: pd.Series(point(list(v)))).unstack()
    table["throughput_median"], table["throughput_lo"], table["throughput_hi"] = spread["median"], spread["lo"], spread["hi"]
    table = table.reset_index()
    _pool_single_workers(ok, table)

    single = table[table["world_size"] == 1]
    own = single.set_index("config_key")["throughput"]
    common = single.groupby("setting_key")["throughput"].max()
    table["speedup"] = table["throughput"] / table["config_key"].map(own)
    table["speedup_std"] = table["throughput_std"] / table["config_key"].map(own)
    table["efficiency"] = table["speedup"] / table["world_size"]
    table["efficiency_std"] = table["speedup_std"] / table["world_size"]
    table["efficiency_common"] = table["throughput"] / table["setting_key"].map(common) / table["world_size"]
    table = table.sort_values(["option", "config_key", "world_size"]).reset_index(drop=True)
    table["marginal_speedup"] = _marginal(table)
    table["verdict"] = ""
    for _, group in table.groupby(["setting_key", "world_size"], dropna=False):  # who is fastest, and who ties
        points = [{"median": r.throughput_median, "lo": r.throughput_lo, "hi": r.throughput_hi} for r in group.itertuples()]
        table.loc[group.index, "verdict"] = verdicts(points, higher_is_better=True)
    return table


def _pool_single_workers(runs: pd.DataFrame, table: pd.DataFrame) -> None:
    """One worker that moves no bytes runs the same computation under every synchronizer (all-reduce,
    ring and tree are no-ops at n = 1): its runs of one setting are pooled into one point, so that
    noise between them does not show as a difference between synchronizers. A synchronizer that
    communicates even alone (a parameter server's round trip) keeps its own point."""
    measured = ~runs["simulated"].astype(bool) if "simulated" in runs.columns else True
    # Predictions are exact, not noisy: a simulated run keeps its own point.
    alone = runs[(runs["world_size"] == 1) & (runs["bytes_per_step"].fillna(0) == 0) & measured]
    for key, group in alone.groupby("setting_key", dropna=False):
        pooled = point(list(group["throughput"]))
        rows = (table["world_size"] == 1) & (table["setting_key"] == key) & table["option"].isin(group["option"])
        table.loc[rows, ["throughput", "throughput_median", "throughput_lo", "throughput_hi"]] = (
            pooled["mean"], pooled["median"], pooled["lo"], pooled["hi"])
        table.loc[rows, "throughput_std"] = group["throughput"].std() if len(group) > 1 else 0.0
        table.loc[rows, "repeats"] = len(group)


def _marginal(table: pd.DataFrame) -> pd.Series:
    out = pd.Series(float("nan"), index=table.index)
    for _, group in table.groupby("config_key", dropna=False):
        group = group.sort_values("world_size")
        prev_n, prev_s = None, None
        for idx, row in group.iterrows():
            if prev_n is not None and row["world_size"] > prev_n:
                out[idx] = (row["speedup"] - prev_s) / (row["world_size"] - prev_n)
            prev_n, prev_s = row["world_size"], row["speedup"]
    return out


def aggregate_by(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """Means and spread over repeats per (sync, world_size, value of the swept override ``key``)."""
    measures = [m for m in VERSUS if m in runs.columns]
    runs = runs.copy()
    name = key.removeprefix("set:").lstrip("+")
    # Lines apart by everything else the runs set (an optimizer, a scaling rule), never averaged together.
    runs["series"] = [run_key(o.split(",") if o else [], ignore=(f"{name}=", f"+{name}=", *QUIET))
                      for o in runs["overrides"].fillna("")]
    grouped = runs.groupby(["option", "series", "world_size", key], dropna=False)
    table = grouped[measures].mean()
    for m in measures:
        table[f"{m}_std"] = grouped[m].std().fillna(0.0)
    return table.reset_index()


def swept_keys(runs: pd.DataFrame) -> list[str]:
    """Overrides other than sync, world_size and seed that take several numeric values in the runs."""
    keys = []
    for column in runs.columns:
        if not column.startswith("set:") or column in ("set:sync", "set:world_size", "set:seed"):
            continue
        values = runs[column].dropna()
        if values.nunique() > 1 and pd.api.types.is_numeric_dtype(values):
            keys.append(column)
    return keys


PHASES = ("t_data", "t_injected", "t_forward", "t_backward", "t_optimizer", "t_wait", "t_encode", "t_decode", "t_sync")


def breakdown(runs: pd.DataFrame) -> pd.DataFrame:
    """Median phase times per run (ms), with sync split into waiting for peers, a codec's encoding
    and decoding (where a run has one; overlapped with backward, part of them was hidden) and the
    rest, the transfer."""
    ok = runs[runs["status"] == "ok"].copy()
    cols = [c for c in PHASES if c in ok.columns]
    frame = ok[["option", "world_size", "overrides", *cols]].copy()
    if "t_sync" in frame.columns:
        inside = [c for c in ("t_wait", "t_encode", "t_decode") if c in frame.columns]
        frame["t_sync"] = (frame["t_sync"] - sum(frame[c].fillna(0.0) for c in inside)).clip(lower=0.0)
    for c in cols:
        frame[c] = 1e3 * frame[c].fillna(0.0)
    return frame.rename(columns={"t_sync": "t_transfer"})


def loss_curves(runs: pd.DataFrame, steps: pd.DataFrame, window: int = 5) -> pd.DataFrame:
    """Rank 0's loss against wall-clock time since the run started, one row per step.

    ``time`` is the sum of rank 0's step times (warm-up included: it is time the run spent);
    ``smoothed`` is a trailing mean over ``window`` steps, since a mini-batch loss is noisy.
    """
    if steps.empty or "loss" not in steps.columns:
        return pd.DataFrame()
    ok = runs[runs["status"] == "ok"].set_index("source")
    rank0 = steps[(steps["rank"] == 0) & steps["source"].isin(ok.index)].sort_values(["source", "step"])
    frames = []
    for source, g in rank0.groupby("source"):
        run = ok.loc[source]
        frames.append(pd.DataFrame({
            "source": source, "option": run["option"], "setting": run["setting"], "world_size": run["world_size"],
            "step": g["step"].to_numpy(), "time": g["t_step"].cumsum().to_numpy(), "loss": g["loss"].to_numpy(),
            "smoothed": g["loss"].rolling(window, min_periods=1).mean().to_numpy(),
        }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def time_to_target(curves: pd.DataFrame, target: float | None = None) -> tuple[pd.Series, float]:
    """(seconds until each run's smoothed loss first reaches ``target``, the target used).

    The default target is the highest final smoothed loss among the runs, the best loss every run
    reached, so each run has a time; a run that never reaches a given target gets NaN.
    """
    if curves.empty:
        return pd.Series(dtype=float), float("nan")
    if target is None:
        target = float(curves.groupby("source")["smoothed"].last().max())
    reached = curves[curves["smoothed"] <= target]
    times = reached.groupby("source")["time"].min()
    return times.reindex(curves["source"].unique()), target
