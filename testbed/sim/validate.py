"""Predicted against measured step time for every measured run of some sweeps (figure 9).

Each run is predicted from its own config with the link fits of a calibration file and the compute
time of a single-worker run of the same setting in the sweeps: preferably one that does not
communicate (allreduce, ring or none at world_size 1), else the run's own configuration at
world_size 1. A run that is its own compute source is predicted but marked, and left out of the
error: its compute was not predicted.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from testbed import config
from testbed.results.summary import load_summaries
from testbed.sim.step import simulate

NO_COMM = ("allreduce", "ring", "none")
VARYING = ("world_size=", "seed=")


def _setting(overrides: list[str], drop_sync: bool) -> str:
    skip = VARYING + (("sync=",) if drop_sync else ())
    return ",".join(sorted(o for o in overrides if not o.startswith(skip) and not o.startswith("hydra.")))


def _compute_source(summary: dict[str, Any], singles: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    overrides = summary.get("overrides") or []
    setting, own = _setting(overrides, True), _setting(overrides, False)
    candidates = [s for s in singles if _setting(s.get("overrides") or [], True) == setting]
    quiet = [s for s in candidates if s["config"]["sync"]["name"] in NO_COMM]
    if quiet:
        return quiet[0]
    same = [s for s in candidates if _setting(s.get("overrides") or [], False) == own]
    return same[0] if same else None


def validate(roots: list[Path], calibration: str, cores: Optional[int]) -> list[dict[str, Any]]:
    """One row per measured run: its sync option, world size, measured and predicted step time."""
    summaries = [s for s in load_summaries(roots) if s.get("status") == "ok" and not s.get("simulated")]
    singles = [s for s in summaries if s["world_size"] == 1]
    rows = []
    for summary in summaries:
        overrides = summary.get("overrides") or []
        option = next((o.split("=", 1)[1] for o in overrides if o.startswith("sync=")), summary["sync"])
        row: dict[str, Any] = {"job": summary["job_dir"], "option": option, "world_size": summary["world_size"],
                               "setting": _setting(overrides, True), "measured": summary["step_time"]}  # fmt: skip
        source = _compute_source(summary, singles)
        if source is None:
            rows.append({**row, "predicted": math.nan, "note": "no single-worker run of this setting"})
            continue
        plain = dict(summary["config"])  # runs older than the `sim` node get its defaults
        plain["sim"] = {**asdict(config.SimConfig()), "calibration": calibration, "cores": cores,
                        "compute_from": source["job_dir"]}  # fmt: skip
        try:
            predicted = simulate(OmegaConf.create(plain))["step_time"]
            note = "compute source" if source["job_dir"] == summary["job_dir"] else ""
        except config.ConfigError as exc:
            predicted, note = math.nan, str(exc)
        rows.append({**row, "predicted": predicted, "note": note})
    return rows


def geometric_error(pairs: list[tuple[float, float]]) -> float:
    """exp(mean |ln(predicted / measured)|) - 1: predicting half or double count alike."""
    logs = [abs(math.log(p / m)) for p, m in pairs if p > 0 and m > 0]
    return math.expm1(sum(logs) / len(logs)) if logs else math.nan
