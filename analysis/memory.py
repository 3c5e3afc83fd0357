"""Memory per rank against throughput: ZeRO's Figure 1 (Rajbhandari et al. 2020), measured.

Each run's ``memory`` (testbed.memory) holds every rank's model state counted from its tensors
(parameters, gradients, optimizer state) and ZeRO's formula for it, and the measured peak resident
set above the process's baseline before the model was built. The table sets these per model, world
size and synchronizer beside ddp's at the same point, with throughput and its 95 % interval over
the seeds; the figure draws, per model at the largest world size, the model state per rank against
throughput, with the formula of each ZeRO stage as a vertical line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.stats import cell, point, verdicts  # noqa: E402
from testbed.memory import Sharding, state_per_element, zero_formula  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402

MB = 2**20
REFERENCE = "ddp"  # what every synchronizer's memory and speed are set against


def _most(per_rank: list[dict[str, int] | None], key: str) -> float | None:
    """The largest rank's value: the rank whose memory bounds the model a machine can train."""
    values = [r[key] for r in per_rank if r is not None]
    return max(values) / MB if values else None


def table(summaries: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per ok, measured run that counted its model state."""
    rows = []
    for s in summaries:
        memory = s.get("memory") or {}
        states = memory.get("model_state") or []
        if s.get("status") != "ok" or s.get("simulated") or not states or None in states:
            continue
        formula = memory.get("formula") or []
        peaks = [p - b for p, b in zip(memory.get("peak_rss_bytes") or [], memory.get("baseline_rss_bytes") or [])]
        rows.append({
            "model": s["config"]["model"]["name"], "world_size": s["world_size"], "sync": s["sync_label"],
            "seed": s["config"]["seed"], "throughput": s["throughput"],
            **{f"{kind}_mb": _most(states, kind) for kind in ("params", "grads", "optimizer", "total")},
            "formula_mb": _most(formula, "total") if formula and None not in formula else None,
            "peak_mb": max(peaks) / MB if peaks else None,
            "psi": s.get("gradient_bytes"),
        })
    return pd.DataFrame(rows)


def summary_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """Per model, world size and synchronizer: the model state (counted, by the formula, and as a
    fraction of ddp's), the measured peak and throughput with their intervals, throughput as a
    fraction of ddp's, and which was fastest (a "tie" where the intervals overlap)."""
    rows = []
    for (model, n), at in runs.groupby(["model", "world_size"], sort=True):
        reference = at[at["sync"] == REFERENCE]
        ref_state = reference["total_mb"].mean() if not reference.empty else math.nan
        ref_speed = reference["throughput"].mean() if not reference.empty else math.nan
        groups = list(at.groupby("sync", sort=True))
        fastest = verdicts([point(g["throughput"].tolist()) for _, g in groups], higher_is_better=True)
        for (sync, group), verdict in zip(groups, fastest):
            state, speed = group["total_mb"].mean(), group["throughput"].mean()
            formula = group["formula_mb"].dropna()
            rows.append({
                "model": model, "n": n, "sync": sync, "runs": len(group), "state": f"{state:.1f}",
                "formula": f"{formula.mean():.1f}" if not formula.empty else "-",
                "state_vs": f"{state / ref_state:.2f}" if ref_state == ref_state else "-",
                "peak": cell(group["peak_mb"].dropna().tolist(), 0),
                "throughput": cell(group["throughput"].tolist(), 0),
                "speed_vs": f"{speed / ref_speed:.2f}" if ref_speed == ref_speed else "-",
                "verdict": verdict,
            })
    return pd.DataFrame(rows)


COLUMNS = {"model": "model", "n": "n", "sync": "sync", "runs": "runs", "state": "model state MB/rank",
           "formula": "formula MB", "state_vs": "state / ddp", "peak": "peak MB (RSS above baseline)",
           "throughput": "samples/s", "speed_vs": "speed / ddp", "verdict": "fastest"}


def stage_lines(psi_bytes: int, n: int, k: int) -> dict[str, float]:
    """Model-state MB per rank by ZeRO's formula for each stage, float32, ``k`` optimizer elements
    per parameter element (AdamW: 2), at world size ``n``."""
    psi = psi_bytes // 4
    lines = {}
    for name, stage in (("ddp", None), ("stage 1", 1), ("stage 2", 2), ("stage 3", 3)):
        lines[name] = zero_formula(Sharding(stage, psi, -(-psi // n), 4, 0), k)["total"] / MB
    return lines


def figure(runs: pd.DataFrame, out: Path, k: int) -> list[Path]:
    models = sorted(runs["model"].unique())
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7.2), squeeze=False)
    syncs = sorted(runs["sync"].unique())
    markers = dict(zip(syncs, "os^vD<>phX*"))
    for col, model in enumerate(models):
        at = runs[runs["model"] == model]
        n = int(at["world_size"].max())
        at = at[at["world_size"] == n]
        means = at.groupby("sync").agg(total=("total_mb", "mean"), peak=("peak_mb", "mean"),
                                       speed=("throughput", "mean"), psi=("psi", "first"))
        top, bottom = axes[0][col], axes[1][col]
        for sync, row in means.iterrows():
            top.scatter(row["total"], row["speed"], marker=markers[sync], s=50, label=sync)
            bottom.scatter(row["peak"], row["speed"], marker=markers[sync], s=50, label=sync)
        for name, mb in stage_lines(int(means["psi"].iloc[0]), n, k).items():
            top.axvline(mb, color="grey", linestyle=":", linewidth=1)
            top.annotate(name, (mb, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                         va="top", ha="right", color="grey")
        top.set_title(f"{model}, n = {n}: model state (dotted: ZeRO's formula)")
        top.set_xlabel("model state per rank MB (counted from its tensors)")
        bottom.set_title(f"{model}, n = {n}: measured")
        bottom.set_xlabel("peak RSS above the baseline MB (largest rank)")
        for ax in (top, bottom):
            ax.set_ylabel("samples/s")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    return _save(fig, out, "memory")


def analyse(summaries: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """The memory figure and the report's section; nothing when fewer than two synchronizers counted."""
    runs = table(summaries)
    if runs.empty or runs["sync"].nunique() < 2:
        return [], ""
    optim = next(s["config"]["optim"] for s in summaries if (s.get("memory") or {}).get("model_state"))
    k = state_per_element(OmegaConf.create(optim))
    section = ("## Memory against speed\n\nModel state per rank (the largest rank's), counted from its tensors and "
               "by ZeRO's formula, as a fraction of ddp's at the same point; the peak resident set above the "
               "process's baseline before the model was built; throughput (means over the seeds, 95 % "
               "intervals) and which synchronizer was fastest (tie: the intervals overlap). A parameter "
               "server's workers hold no optimizer state: its servers do, which is not counted here.\n\n"
               + markdown_table(summary_rows(runs), COLUMNS) + "\n")
    return figure(runs, out, k), section
