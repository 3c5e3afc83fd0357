"""The statistical half: held-out quality against wall-clock and against samples, and time to the
quality target across repeats (median, 95 % interval, MLPerf's score, ties named).

Reads each job's ``metrics/eval.jsonl`` and summary.json ``time_to_target`` (testbed.eval). Wall-
clock is MLPerf's: the run's clock never stops, evaluation included. Accuracy against samples
separates the statistical half (how much each sample improves the model: staleness, compression,
local steps, the global batch) from the hardware half (how fast samples go through).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save, _workers_axis  # noqa: E402
from analysis.stats import cell, mlperf_score, point, verdicts  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402
from testbed.results.keys import run_key  # noqa: E402


def eval_curves(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per evaluation of every successful local run: its run's labels and the eval record."""
    rows = []
    for run in runs[runs["status"] == "ok"].itertuples():
        path = Path(str(run.source)) / "metrics" / "eval.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows.append({"source": run.source, "option": run.option, "setting": run.setting,
                         "world_size": run.world_size, "seed": run.seed, "clock": getattr(run, "clock", "wall"),
                         **record})
    return pd.DataFrame(rows)


# The override prefixes that tell the contestants of one race apart.
RACERS = ("sync=", "sync.", "compress=", "compress.", "balance=", "balance.")


def target_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per configuration and n over its repeats: runs, reached, time to target (median, interval,
    MLPerf's score), steps and epochs to it (medians), the final held-out accuracy, and the verdict."""
    ok = runs[(runs["status"] == "ok") & runs["target_metric"].notna()].copy()
    if ok.empty:
        return pd.DataFrame()
    # The race: runs that differ only in how they synchronize (synchronizer, its options, codec,
    # balanced batches; and seed, n) train the same model on the same data to the same target.
    ok["race"] = [run_key(o.split(",") if o else [], ignore=RACERS) for o in ok["overrides"].fillna("")]
    if "clock" not in ok.columns:
        ok["clock"] = "wall"
    rows = []
    for (key, option, setting, clock, n), group in ok.groupby(["config_key", "option", "setting", "clock", "world_size"],
                                                              dropna=False):
        times = [t if r else math.nan for t, r in zip(group["tta_s"], group["tta_reached"])]
        spread = point(times)
        rows.append({
            "config_key": key, "race": group["race"].iloc[0], "option": option, "setting": setting, "clock": clock,
            "world_size": n, "runs": len(group), "reached": int(group["tta_reached"].sum()),
            "target": f"{group['target_metric'].iloc[0]} {group['target_value'].iloc[0]:g}",
            "tta_median": spread["median"], "tta_lo": spread["lo"], "tta_hi": spread["hi"],
            "tta_mlperf": mlperf_score(times),
            "steps_median": group["tta_steps"].median(), "epochs_median": group["tta_epochs"].median(),
            "eval_share": group["tta_eval_share"].median(),
            "final_accuracy": group["eval_accuracy"].median(),
        })
    table = pd.DataFrame(rows).sort_values(["race", "world_size", "tta_median"]).reset_index(drop=True)
    table["verdict"], table["paired"], table["paired_verdict"] = "", "", ""
    for _, group in table.groupby(["race", "world_size"], dropna=False):
        points = [{"median": r.tta_median, "lo": r.tta_lo, "hi": r.tta_hi} for r in group.itertuples()]
        table.loc[group.index, "verdict"] = verdicts(points, higher_is_better=False)
        best = group.index[0]  # sorted: the fastest median first
        for i in group.index[1:]:
            table.loc[i, ["paired", "paired_verdict"]] = _paired(ok, table.loc[i], table.loc[best])
    return table


def _paired(ok: pd.DataFrame, row: pd.Series, best: pd.Series) -> tuple[str, str]:
    """``row``'s time to target over the best's, seed by seed (the same seed draws the same model,
    data order and, on a virtual cluster, compute), the mean ratio with its 95 % interval, and
    "slower" where the interval lies above 1. A run that did not reach the target has no ratio."""
    def times(r: pd.Series) -> dict[Any, float]:
        runs = ok[(ok["config_key"] == r["config_key"]) & (ok["world_size"] == r["world_size"]) & ok["tta_reached"]]
        return dict(zip(runs["seed"], runs["tta_s"]))

    if "seed" not in ok.columns:
        return "", ""
    mine, theirs = times(row), times(best)
    ratios = [mine[s] / theirs[s] for s in mine.keys() & theirs.keys() if theirs[s] > 0]
    if len(ratios) < 2:
        return "", ""
    spread = point(ratios)
    return cell(ratios, 2), "slower" if spread["lo"] > 1 else "tie"


COLUMNS = {
    "option": "sync", "setting": "setting", "clock": "clock", "world_size": "n", "target": "target", "runs": "runs",
    "reached": "reached",
    "tta_median": "median s", "tta_lo": "95 % lo", "tta_hi": "95 % hi", "tta_mlperf": "MLPerf score s",
    "steps_median": "steps", "epochs_median": "epochs", "eval_share": "eval share", "final_accuracy": "final acc.",
    "verdict": "at this n", "paired": "× best, by seed", "paired_verdict": "paired",
}


def curves_figure(curves: pd.DataFrame, out: Path) -> list[Path]:
    """Held-out accuracy (or loss) against wall-clock and against samples, one line per run."""
    metric = "accuracy" if "accuracy" in curves.columns else "loss"
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    curves = curves.assign(option=[o if not s else f"{o} ({s})" for o, s in zip(curves["option"], curves["setting"])])
    labels = sorted(curves["option"].astype(str).unique())
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    styles = {n: ls for n, ls in zip(sorted(curves["world_size"].unique()), ("-", "--", ":", "-."))}
    drawn = set()
    for (_, option, n), g in curves.groupby(["source", "option", "world_size"]):
        g = g.sort_values("step")
        label = f"{option} n={n}" if (option, n) not in drawn else None
        drawn.add((option, n))
        kw = {"color": colors[str(option)], "ls": styles.get(n, "-"), "lw": 1, "alpha": 0.8, "marker": "."}
        ax_t.plot(g["time_s"], g[metric], label=label, **kw)
        ax_s.plot(g["samples_seen"], g[metric], **kw)
    simulated = "clock" in curves.columns and (curves["clock"] == "simulated").all()
    ax_t.set_xlabel(f"{'simulated clock' if simulated else 'wall-clock'} s (evaluation included)")
    ax_s.set_xlabel("samples seen")
    ax_t.set_ylabel(f"held-out {metric}")
    ax_t.set_title("the whole race")
    ax_s.set_title("the statistical half: per sample")
    ax_t.legend(fontsize=7, ncol=2)
    return _save(fig, out, "accuracy")


def target_figure(table: pd.DataFrame, out: Path) -> list[Path]:
    """Time to target against workers, the median with its 95 % interval, one line per synchronizer
    and one panel per setting (e.g. each described cluster); at one n, one row per configuration
    (with its paired ratio to the best where there is one)."""
    if table["world_size"].nunique() == 1:
        return _target_rows(table, out)
    settings = sorted(table["setting"].fillna("").unique())
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    options = sorted(table["option"].astype(str).unique())
    colors = {option: f"C{i % 10}" for i, option in enumerate(options)}
    markers = {option: "osD^v<>ph*"[(i // 10) % 10] for i, option in enumerate(options)}
    for ax, setting in zip(axes[0], settings):
        panel = table[table["setting"].fillna("") == setting]
        both = panel["clock"].nunique() > 1  # real runs beside virtual ones: dashed virtual
        for (option, clock), g in sorted(panel.groupby(["option", "clock"]), key=lambda x: str(x[0])):
            g = g.sort_values("world_size")
            name = str(option) + (f" ({'virtual' if clock == 'simulated' else 'real'})" if both else "")
            low = (g["tta_median"] - g["tta_lo"]).clip(lower=0).fillna(0)
            high = (g["tta_hi"] - g["tta_median"]).clip(lower=0).fillna(0)
            ax.errorbar(g["world_size"], g["tta_median"], yerr=[low, high], capsize=3, marker=markers[str(option)],
                        color=colors[str(option)], ls="--" if both and clock == "simulated" else "-", label=name)
        if both:
            real = set(panel.loc[panel["clock"] == "wall", "world_size"])
            overlap = sorted(real & set(panel.loc[panel["clock"] == "simulated", "world_size"]))
            if overlap:
                ax.axvspan(min(overlap) / 1.3, max(overlap) * 1.3, color="0.9", zorder=0, label="real and virtual overlap")
        _workers_axis(ax, sorted(panel["world_size"].unique()))
        ax.set_xlabel("workers")
        ax.set_ylabel("time to target s (median, 95 % interval)")
        ax.set_title(f"time to {table['target'].iloc[0]}" + (f": {setting}" if setting else ""))
        times = panel["tta_median"].dropna()
        if both or (len(times) and times.max() > 20 * times.min() > 0):  # a wide range: every line readable
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out, "time_to_target")


def overlap_table(table: pd.DataFrame) -> pd.DataFrame:
    """Where real runs and virtual ones (launcher=virtual) share a synchronizer, setting and n: both
    times to target and the virtual one's ratio to the real one, of medians, with whether the
    intervals overlap."""
    real, virtual = table[table["clock"] == "wall"], table[table["clock"] == "simulated"]
    if real.empty or virtual.empty:
        return pd.DataFrame()
    keys = ["option", "setting", "world_size"]
    both = real.merge(virtual, on=keys, suffixes=("_real", "_virtual"))
    both["ratio"] = both["tta_median_virtual"] / both["tta_median_real"]
    both["agree"] = [
        "overlap" if max(a_lo, b_lo) <= min(a_hi, b_hi) else "apart"
        for a_lo, a_hi, b_lo, b_hi in zip(both["tta_lo_real"], both["tta_hi_real"], both["tta_lo_virtual"], both["tta_hi_virtual"])
    ]
    both["steps_ratio"] = both["steps_median_virtual"] / both["steps_median_real"]
    return both.sort_values(keys).reset_index(drop=True)


OVERLAP_COLUMNS = {
    "option": "sync", "setting": "setting", "world_size": "n",
    "tta_median_real": "real s", "tta_lo_real": "lo", "tta_hi_real": "hi",
    "tta_median_virtual": "virtual s", "tta_lo_virtual": "lo ", "tta_hi_virtual": "hi ",
    "ratio": "virtual / real", "agree": "intervals", "steps_ratio": "steps virtual / real",
}


def _target_rows(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = table.sort_values("tta_median", ascending=False, na_position="first").reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    labels = []
    for i, row in rows.iterrows():
        name = row["option"] if not row["setting"] else f"{row['option']} ({row['setting']})"
        if not math.isfinite(row["tta_median"]):
            labels.append(f"{name}: not reached ({row['reached']} of {row['runs']})")
            continue
        labels.append(name + (f"\n×{row['paired']} by seed" if row["paired"] else "\nfastest of its race"))
        low = 0.0 if math.isnan(row["tta_lo"]) else max(0.0, row["tta_median"] - row["tta_lo"])
        high = 0.0 if math.isnan(row["tta_hi"]) else max(0.0, row["tta_hi"] - row["tta_median"])
        ax.errorbar([row["tta_median"]], [i], xerr=[[low], [high]], capsize=3, marker="o", color=f"C{i % 10}")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(left=0)
    ax.set_xlabel("time to target s (median, 95 % interval)")
    ax.set_title(f"time to {table['target'].iloc[0]} at n = {int(table['world_size'].iloc[0])}")
    fig.tight_layout()
    return _save(fig, out, "time_to_target")


def analyse(runs: pd.DataFrame, out: Path) -> tuple[list[Path], str]:
    """The figures and report section of the held-out evaluation; nothing when no run evaluated."""
    curves = eval_curves(runs) if "source" in runs.columns else pd.DataFrame()
    written: list[Path] = []
    parts: list[str] = []
    if not curves.empty:
        written += curves_figure(curves, out)
    table = target_table(runs) if "target_metric" in runs.columns else pd.DataFrame()
    if not table.empty:
        written += target_figure(table, out)
        parts += [
            "## Time to the held-out target",
            "",
            "MLPerf's clock: from the first step, never stopped, evaluation included ('eval share' is its part). "
            "Medians over the repeats that reached the target, the 95 % t interval of their mean, and MLPerf's "
            "score (drop the fastest and the slowest run, average the rest; a run that did not reach counts as "
            "slowest). At each n, 'best' is the fastest median and 'tie' marks intervals that overlap its interval. "
            "Paired by seed (a seed draws the same model, data order and virtual cluster in every run): each run's "
            "time over the best's run of the same seed, the mean ratio with its 95 % interval, 'slower' where it "
            "lies above 1.",
            "",
            markdown_table(table, COLUMNS),
            "",
        ]
        overlap = overlap_table(table)
        if not overlap.empty:
            parts += [
                "## Virtual beside real",
                "",
                "Where real runs (this machine's wall-clock) and virtual ones (launcher=virtual: the described "
                "cluster's simulated clock, the same math) share a synchronizer and n: the medians, their 95 % "
                "intervals, and the virtual one's ratio to the real one. Steps to target agree where the math does; "
                "times part where this machine is not the cluster described (ranks sharing cores, loopback for links).",
                "",
                markdown_table(overlap, OVERLAP_COLUMNS),
                "",
            ]
    if not curves.empty:
        final = curves.sort_values("step").groupby("source").tail(1)
        metric = "accuracy" if "accuracy" in final.columns else "loss"
        by = final.groupby(["option", "setting", "world_size"], dropna=False)[metric]
        summary = by.agg(["median", "min", "max", "count"]).reset_index()
        parts += [f"## Final held-out {metric}", "",
                  markdown_table(summary, {"option": "sync", "setting": "setting", "world_size": "n", "median": "median", "min": "min",
                                           "max": "max", "count": "runs"}), ""]
    return written, "\n".join(parts)
