"""Elastic membership against a restart: downtime, lost work and time to target per synchronizer.

A run's recovery is read from its summary: ``elastic`` when its membership changed (testbed.elastic),
``rejoin`` when a newcomer later took the lost worker's place, ``restart`` when the launcher started
it again from a checkpoint (``attempts``), ``uninterrupted`` when it ran elastic and lost no one (the
reference). Downtime is, for each, the seconds from the launcher seeing the loss to the first step
completed after it; the work lost is the steps done again: the interrupted one and the completed
ones rolled back (elastic), or every step after the checkpoint the restart continued from
(restart). A join's own pause is its column beside. The figure sets samples against wall-clock for
one seed, and the downtime of each recovery beside the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.stats import cell, point, verdicts  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402
from testbed.results.step_log import read_step_log  # noqa: E402

# Each recovery's line style and colour, alike in every panel.
STYLES = {"elastic": ("-", "C0"), "rejoin": ("-.", "C3"), "restart": ("--", "C1"), "uninterrupted": (":", "C2")}


def recovery_of(summary: dict[str, Any]) -> str | None:
    membership, attempts = summary.get("membership") or [], summary.get("attempts") or []
    if any(change.get("joined") for change in membership):
        return "rejoin"
    if len(membership) > 1:
        return "elastic"
    if attempts:
        return "restart"
    if membership:
        return "uninterrupted"
    return None


def _loss(summary: dict[str, Any], recovery: str) -> tuple[float | None, int | None]:
    """(downtime in seconds, steps done again) of the run's first loss."""
    if recovery in ("elastic", "rejoin"):
        change = summary["membership"][1]
        redone = change["rolled_back_steps"] + (change["interrupted_step"] is not None)
        return change.get("downtime_s"), redone
    if recovery == "restart":
        failure = summary["attempts"][0]
        failed, resumed = failure["error"].get("step"), failure.get("resumed_from_step")
        redone = None if failed is None else failed - (-1 if resumed is None else resumed)
        return failure.get("downtime_s"), redone
    return None, None


def table(summaries: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per ok run with a recovery: synchronizer, recovery, seed, downtime, steps redone,
    time to target."""
    rows = []
    for s in summaries:
        recovery = recovery_of(s)
        if recovery is None or s.get("status") != "ok" or s.get("simulated"):
            continue
        downtime, redone = _loss(s, recovery)
        reached = s.get("time_to_target") or {}
        joins = [c["downtime_s"] for c in s.get("membership") or [] if c.get("joined")]
        rows.append({"sync": s["sync_label"], "recovery": recovery, "seed": s["config"]["seed"],
                     "downtime_s": downtime, "redone_steps": redone, "join_s": joins[0] if joins else None,
                     "time_to_target_s": reached.get("seconds") if reached.get("reached") else None,
                     "job_dir": s.get("job_dir")})
    return pd.DataFrame(rows)


def summary_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """Per synchronizer and recovery: means with their 95 % intervals over the seeds, and which
    recovery reached the target first under each synchronizer (a "tie" where the intervals overlap)."""
    rows = []
    for sync, by_sync in runs.groupby("sync", sort=True):
        groups = list(by_sync.groupby("recovery", sort=True))
        reached = verdicts([point(g["time_to_target_s"].dropna().tolist()) for _, g in groups], higher_is_better=False)
        for (recovery, group), verdict in zip(groups, reached):
            rows.append({"sync": sync, "recovery": recovery, "runs": len(group),
                         "downtime": cell(group["downtime_s"].dropna().tolist(), 3),
                         "redone": cell(group["redone_steps"].dropna().tolist(), 1),
                         "join": cell(group["join_s"].dropna().tolist(), 3),
                         "to_target": cell(group["time_to_target_s"].dropna().tolist(), 2), "verdict": verdict})
    return pd.DataFrame(rows)


COLUMNS = {"sync": "sync", "recovery": "recovery", "runs": "runs", "downtime": "downtime s",
           "redone": "steps redone", "join": "join s", "to_target": "time to target s",
           "verdict": "to target"}


def _member(membership: list[dict[str, Any]], worker: int, step: int) -> bool:
    """Whether the worker was a member at the step: of the last membership begun by then."""
    current = [m for m in membership if m["step"] <= step]
    return not current or worker in current[-1]["members"]


def samples_over_time(job_dir: Path) -> tuple[list[float], list[int]]:
    """Seconds since the run's first step began, and samples in the final model by then, at the end
    of each of its steps. A rolled-back step's records are gone from the survivors' logs and a
    restart rewrites the logs from its checkpoint; what a lost worker logged from the step its
    successors' membership began at is not in the final model, and is left out here."""
    path = job_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    membership = summary.get("membership") or []
    begun, ends = float("inf"), []
    for path in sorted((job_dir / "metrics").glob("rank*.jsonl")):
        for r in read_step_log(path):
            if not _member(membership, r["rank"], r["step"]):
                continue
            begun = min(begun, r["t_sync_enter"] - r["t_data"] - r["t_injected"] - r["t_forward"] - r["t_backward"])
            ends.append((r["t_sync_exit"] + r["t_optimizer"], r["samples"]))
    ends.sort()
    times, samples, total = [], [], 0
    for t, n in ends:
        total += n
        times.append(t - begun)
        samples.append(total)
    return times, samples


def figure(runs: pd.DataFrame, out: Path) -> list[Path]:
    seed = runs["seed"].min()
    syncs = sorted(runs["sync"].unique())
    fig, axes = plt.subplots(1, len(syncs) + 1, figsize=(4 * (len(syncs) + 1), 3.6))
    for ax, sync in zip(axes, syncs):
        for _, row in runs[(runs["sync"] == sync) & (runs["seed"] == seed)].iterrows():
            times, samples = samples_over_time(Path(row["job_dir"]))
            style, colour = STYLES[row["recovery"]]
            ax.plot(times, [s / 1e3 for s in samples], style, color=colour, label=row["recovery"])
        ax.set_title(f"{sync} (seed {seed})")
        ax.set_xlabel("wall-clock s")
        ax.set_ylabel("samples trained (thousands)")
        ax.legend(fontsize=8)
    ax = axes[-1]
    lost = runs[runs["recovery"] != "uninterrupted"]
    recoveries = [r for r in STYLES if r in set(lost["recovery"])]
    width = 0.8 / len(recoveries)
    for i, recovery in enumerate(recoveries):
        means = [lost[(lost["sync"] == s) & (lost["recovery"] == recovery)]["downtime_s"].mean() for s in syncs]
        ax.bar([x + width * i for x in range(len(syncs))], means, width=width, color=STYLES[recovery][1],
               label=recovery)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(syncs))], syncs, rotation=20)
    ax.set_yscale("log")
    ax.set_ylim(top=lost["downtime_s"].max() * 20)  # room for the legend above the bars
    ax.set_ylabel("downtime s (loss to the next completed step)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "elastic")


def analyse(summaries: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """The elastic figure and the report's section; nothing when no run recovered from a loss."""
    runs = table(summaries)
    if runs.empty or not (runs["recovery"] != "uninterrupted").any():
        return [], ""
    section = ("## Elastic membership against a restart\n\nA worker lost; downtime from the loss to the next "
               "completed step, steps done again, time to target (means over the seeds, 95 % intervals), and "
               "which recovery reached the target first under each synchronizer (tie: the intervals overlap).\n\n"
               + markdown_table(summary_rows(runs), COLUMNS) + "\n")
    return figure(runs, out), section
