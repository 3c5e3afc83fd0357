"""Predicted against measured step time for every measured run of some sweeps (figure 9).

Each run is predicted twice from its own config and the link fits of a calibration file:
- ``predicted``: with the compute time of the run's own step log (its measured forward, backward,
  data and optimizer medians). This validates what extrapolation relies on: the communication,
  overlap, imbalance and synchronization model, given the compute.
- ``predicted_single``: with the compute of a single-worker run of the same setting in the sweeps
  (preferably one that does not communicate, as every all-reduce at world_size 1) slowed by
  ranks sharing ``cores`` cores. This adds the machine's contention, which a cluster (one machine per
  worker) does not have.
Runs that do not communicate (one worker, no parameter server) are listed but not scored.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from omegaconf import OmegaConf

from testbed import config
from testbed.results.keys import run_key
from testbed.sim.step import simulate
from testbed.sync import SYNCHRONIZERS


def _setting(overrides: list[str], drop_sync: bool) -> str:
    """The run's configuration (testbed.results.keys.run_key), without hydra's own overrides and,
    with ``drop_sync``, without its synchronizer."""
    return run_key(overrides, ignore=("hydra.", *(("sync=",) if drop_sync else ())))


def _single_worker(summary: dict[str, Any], singles: list[dict[str, Any]]) -> dict[str, Any] | None:
    overrides = summary.get("overrides") or []
    setting, own = _setting(overrides, True), _setting(overrides, False)
    candidates = [s for s in singles if _setting(s.get("overrides") or [], True) == setting]
    quiet = [s for s in candidates if not _communicates(s)]
    if quiet:
        return quiet[0]
    same = [s for s in candidates if _setting(s.get("overrides") or [], False) == own]
    return same[0] if same else None


def _communicates(summary: dict[str, Any]) -> bool:
    spec = SYNCHRONIZERS.get(summary["config"]["sync"]["name"])
    return spec is not None and spec.sim is not None and (summary["world_size"] > 1 or spec.communicates_alone)


def _predict(summary: dict[str, Any], calibration: str, compute_from: str, cores: int | None) -> tuple[float, str]:
    """The predicted step time, or NaN and why the simulator cannot predict this run."""
    plain = dict(summary["config"])  # runs older than the `sim` node get its defaults
    # Of the run's own sim node only what describes its network (the rate inside a machine).
    own = {key: value for key, value in (plain.get("sim") or {}).items() if key == "intra_bandwidth"}
    plain["sim"] = {**asdict(config.SimConfig()), **own, "calibration": calibration, "cores": cores,
                    "compute_from": compute_from}
    if "addresses" in plain["sync"]:  # the servers' addresses of that run, written by its launcher
        plain["sync"] = {**plain["sync"], "addresses": []}
    plain.setdefault("compress", {"name": "none"})  # runs from before codecs
    try:
        return simulate(OmegaConf.create(plain))["step_time"], ""
    except config.ConfigError as exc:  # e.g. a link the calibration has no fit for
        return math.nan, str(exc).split(";")[0].split(": ", 1)[-1]


def validate(summaries: list[dict[str, Any]], calibration: str, cores: int | None) -> list[dict[str, Any]]:
    """One row per measured run of ``summaries`` (testbed.results.summary.load_summaries, each with
    its ``job_dir``): sync option, world size, setting, measured and predicted step times."""
    summaries = [s for s in summaries if s.get("status") == "ok" and not s.get("simulated")]
    singles = [s for s in summaries if s["world_size"] == 1]
    rows = []
    for summary in summaries:
        overrides = summary.get("overrides") or []
        single = _single_worker(summary, singles)
        predicted, why = _predict(summary, calibration, summary["job_dir"], None)
        predicted_single = _predict(summary, calibration, single["job_dir"], cores)[0] if single else math.nan
        rows.append({
            "job": summary["job_dir"],
            "option": next((o.split("=", 1)[1] for o in overrides if o.startswith("sync=")), summary["sync"]),
            "world_size": summary["world_size"],
            "setting": _setting(overrides, True),
            "global_batch": summary["global_batch"],
            "measured": summary["step_time"],
            "predicted": predicted,
            "predicted_single": predicted_single,
            "note": "no communication" if not _communicates(summary) else why,
        })
    return rows


def geometric_error(pairs: list[tuple[float, float]]) -> float:
    """exp(mean |ln(predicted / measured)|) - 1: predicting half or double count alike."""
    logs = [abs(math.log(p / m)) for p, m in pairs if p > 0 and m > 0]
    return math.expm1(sum(logs) / len(logs)) if logs else math.nan
