"""The comparison in W&B: one analysis run in the sweep's group (``python -m analysis <sweep> --wandb``,
and at the end of a sweep whose jobs log to W&B).

The run (``job_type=analysis``) holds what ``report.md`` holds, as W&B objects: the scaling,
breakdown and time-to-target tables and the per-step times of every rank (``t_wait`` among them,
known only once a run has ended, so never in the job runs' history) as ``wandb.Table``s, every
figure as a ``wandb.Image``, and ``report.md`` with ``summary.csv`` as an artifact. Online, each
job run's summary also gains its ``efficiency``, ``speedup``, ``efficiency_common`` and
``baseline_throughput``, so W&B's own charts (analysis.workspace) can plot and group by them.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import accuracy
from testbed.results.wandb_run import group_name

log = logging.getLogger("analysis")

# Each table's columns, from the frames analysis.__main__ builds.
SCALING = ["option", "setting", "world_size", "repeats", "throughput", "throughput_std", "speedup", "efficiency",
           "efficiency_common", "marginal_speedup", "imbalance", "idle_fraction"]
TIME_TO_TARGET = ["option", "setting", "world_size", "seed", "time_to_target", "final_loss", "overrides"]
STEP_COLUMNS = ["overrides", "sync", "world_size", "rank", "step", "loss", "t_step", "t_sync", "t_wait", "bytes_sent"]


@dataclass
class Target:
    """Where the analysis run goes: the jobs' own project and group, unless told otherwise."""

    mode: str
    project: str
    entity: str | None
    group: str

    @classmethod
    def of(cls, summaries: list[dict[str, Any]], source: str, mode: str | None) -> Target:
        wandb_cfg = next(((s.get("config") or {}).get("wandb") or {} for s in summaries), {})
        groups = {s["wandb_group"] for s in summaries if s.get("wandb_group")}
        group = groups.pop() if len(groups) == 1 else group_name(Path(source))
        jobs_mode = wandb_cfg.get("mode") or "disabled"
        chosen = mode or (jobs_mode if jobs_mode != "disabled" else "offline")
        return cls(chosen, wandb_cfg.get("project") or "testbed", wandb_cfg.get("entity"), group)


def job_updates(runs: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per ok run (keyed by its ``overrides``): its efficiency and speed-up against the single-worker
    runs of its configuration (their mean throughput, ``baseline_throughput``), and its efficiency
    against the fastest single worker of its setting under any synchronizer; runs without a
    single-worker baseline get none."""
    ok = runs[runs["status"] == "ok"]
    single = ok[ok["world_size"] == 1]
    own = single.groupby("config_key")["throughput"].mean()
    common = single.groupby("setting_key")["throughput"].max()
    out: dict[str, dict[str, float]] = {}
    for row in ok.itertuples():
        baseline = own.get(row.config_key, math.nan)
        speedup = row.throughput / baseline
        values = {"speedup": speedup, "efficiency": speedup / row.world_size, "baseline_throughput": baseline,
                  "efficiency_common": row.throughput / common.get(row.setting_key, math.nan) / row.world_size}
        out[row.overrides] = {k: float(v) for k, v in values.items() if not math.isnan(v)}
    return out


def tables(table: pd.DataFrame, breakdown: pd.DataFrame, runs: pd.DataFrame, steps: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The frames the analysis run logs, with their columns where the runs have them."""
    def pick(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
        return frame[[c for c in columns if c in frame.columns]].reset_index(drop=True)

    ok = runs[runs["status"] == "ok"]
    out = {"scaling": pick(table, SCALING), "breakdown": breakdown.reset_index(drop=True)}
    if "time_to_target" in ok.columns:
        out["time_to_target"] = pick(ok.sort_values(["option", "setting", "world_size"]), TIME_TO_TARGET)
    if "target_metric" in runs.columns:  # held-out evaluation (analysis.accuracy)
        out["heldout_target"] = accuracy.target_table(runs)
    if "source" in runs.columns:
        out["heldout_evals"] = accuracy.eval_curves(runs)
    if not steps.empty:
        overrides = runs.set_index("source")["overrides"]
        out["steps"] = pick(steps.assign(overrides=steps["source"].map(overrides)), STEP_COLUMNS)
    return {name: frame for name, frame in out.items() if not frame.empty}


def log_analysis(target: Target, frames: dict[str, pd.DataFrame], figures: list[Path], report: Path,
                 updates: dict[str, dict[str, float]], out: Path) -> str:
    """Log the analysis run (under ``out`` when offline); its directory, or its URL online."""
    import wandb

    run = wandb.init(mode=target.mode, project=target.project, entity=target.entity, group=target.group,
                     job_type="analysis", name=f"analysis {target.group}", dir=str(out), reinit="create_new",
                     settings=wandb.Settings(console="off", silent=True))
    try:
        run.log({f"table/{name}": wandb.Table(dataframe=_plain(frame)) for name, frame in frames.items()}, commit=False)
        run.log({f"figure/{path.stem}": wandb.Image(str(path)) for path in figures if path.suffix == ".png"})
        artifact = wandb.Artifact(f"report-{re.sub(r'[^A-Za-z0-9_.-]+', '-', target.group).strip('-')}", type="report")
        for path in (report, out.parent / "summary.csv"):
            if path.is_file():
                artifact.add_file(str(path), name=path.name)
        run.log_artifact(artifact)
        where = run.url if target.mode == "online" else run.dir
    finally:
        run.finish()
    if target.mode == "online":
        _update_job_runs(target, updates)
    return str(Path(where).parent) if target.mode != "online" else str(where)


def _plain(frame: pd.DataFrame) -> pd.DataFrame:
    """Columns W&B can type: strings for mixed object columns."""
    return frame.apply(lambda c: c.astype(str) if c.dtype == object else c)


def _update_job_runs(target: Target, updates: dict[str, dict[str, float]]) -> None:
    """Write each job run's efficiency into its W&B summary, matched by its overrides (unique in a sweep)."""
    import wandb

    path = f"{target.entity}/{target.project}" if target.entity else target.project
    for run in wandb.Api().runs(path, filters={"group": target.group, "jobType": {"$ne": "analysis"}}):
        values = updates.get(",".join(run.config.get("overrides") or []))
        if values:
            run.summary.update(values)
    log.info("efficiency and speed-up written into the summaries of the W&B group %s", target.group)
