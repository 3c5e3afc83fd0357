"""Load results into tidy frames: one row per run, and one row per rank and step.

Sources: local job or sweep directories (``summary.json`` + ``metrics/rank*.jsonl``, the results
contract of docs/results.md), W&B runs through the public API (``wandb:entity/project/group``),
and offline W&B runs read straight from their ``.wandb`` files, no network needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.results.keys import run_key
from testbed.results.step_log import read_step_log
from testbed.results.summary import load_summaries
from testbed.results.table import sync_label

# Columns of the run frame taken from summary.json as they are.
SUMMARY_COLUMNS = (
    "status", "world_size", "global_batch", "throughput", "step_time", "step_time_p10", "step_time_p90",
    "imbalance", "idle_fraction", "bytes_per_step", "final_loss",
)
# Overrides that do not describe the experiment (where it ran, how it logs) or that a label shows anyway.
QUIET = ("sync=", "compress=", "+experiment=", "device=", "launcher.", "hydra.", "wandb.", "sim.", "sweep_resume=")


def run_row(summary: dict[str, Any], overrides: list[str], source: str) -> dict[str, Any]:
    cfg = summary.get("config") or {}
    row: dict[str, Any] = {"source": source, "sync": sync_label(summary), "seed": cfg.get("seed")}
    row.update({k: summary.get(k) for k in SUMMARY_COLUMNS})
    for phase, spread in (summary.get("phases") or {}).items():
        row[phase] = spread.get("median") if isinstance(spread, dict) else spread
    final = (summary.get("eval") or {}).get("final") or {}
    row["eval_accuracy"], row["eval_loss"] = final.get("accuracy"), final.get("loss")
    target = summary.get("time_to_target") or {}
    row["target_metric"], row["target_value"] = target.get("metric"), target.get("value")
    row["tta_reached"] = bool(target.get("reached"))
    row["tta_s"], row["tta_steps"], row["tta_epochs"] = target.get("seconds"), target.get("steps"), target.get("epochs")
    row["tta_eval_share"] = target.get("t_eval_share")
    row["b_simple"] = (summary.get("noise_scale") or {}).get("b_simple")  # stats.noise_scale only
    row["overrides"] = ",".join(overrides)
    # The sync option as chosen (ps_sharded), which the per-run label (ps-sync k=4) does not keep.
    row["option"] = next((o.split("=", 1)[1] for o in overrides if o.startswith("sync=")), row["sync"])
    codec = next((o.split("=", 1)[1] for o in overrides if o.startswith("compress=")), "none")
    if codec != "none":  # a codec makes its own series: compared with, never averaged into, the plain one
        row["option"] = f"{row['option']}+{codec}"
    row["clock"] = summary.get("clock", "wall")  # a virtual cluster's runs: "simulated" (testbed.launch.virtual)
    row["simulated"] = bool(summary.get("simulated"))
    if row["simulated"]:  # drawn as its own series beside the measured one
        row["option"] = f"{row['option']} (simulated)"
    row["config_key"] = run_key(overrides)
    # What sets the run apart besides its synchronizer and size, for tables and legends.
    row["setting"] = run_key(overrides, ignore=QUIET)
    # A configuration's setting without its synchronizer: runs that differ only there are compared.
    row["setting_key"] = run_key(overrides, ignore=("sync=",))
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.startswith(("hydra.", "+experiment")):
            row[f"set:{key.lstrip('+')}"] = _number(value)
    return row


def _number(value: str) -> Any:
    try:
        return float(value) if any(c in value for c in ".e") else int(value)
    except ValueError:
        return value


def load_local(
    roots: list[Path], summaries: list[dict[str, Any]] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, steps) of every job directory under ``roots``; ``summaries``: theirs, already loaded
    (testbed.results.summary.load_summaries, each with its ``job_dir``), so they are not searched again."""
    runs, steps = [], []
    for summary in load_summaries(roots) if summaries is None else summaries:
        job = Path(summary["job_dir"])
        row = run_row(summary, list(summary.get("overrides") or []), str(job))
        runs.append(row)
        for path in sorted((job / "metrics").glob("rank*.jsonl")):
            for record in read_step_log(path):
                steps.append({"source": str(job), "sync": row["sync"], "world_size": row["world_size"], **record})
    return pd.DataFrame(runs), pd.DataFrame(steps)


def load_wandb(path: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, steps) of the W&B runs of ``entity/project/group`` through the public API."""
    import wandb

    entity, project, group = path.split("/", 2)
    runs, steps = [], []
    for run in wandb.Api().runs(f"{entity}/{project}", filters={"group": group}):
        config = dict(run.config)
        summary = _unflatten(dict(run.summary), config)
        row = run_row(summary, list(config.get("overrides") or []), run.url)
        runs.append(row)
        for record in run.scan_history():
            steps.append({"source": run.url, "sync": row["sync"], "world_size": row["world_size"], **record})
    return pd.DataFrame(runs), pd.DataFrame(steps)


def _unflatten(flat: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A W&B run summary (``phases/t_sync`` keys) back into summary.json's shape."""
    summary: dict[str, Any] = {k: v for k, v in flat.items() if "/" not in k}
    summary["phases"] = {k.split("/", 1)[1]: {"median": v} for k, v in flat.items() if k.startswith("phases/")}
    summary["config"] = config
    return summary


# --- offline W&B runs: the .wandb transaction log, read without the service ------------------

_BLOCK, _HEADER = 32768, 7  # LevelDB log format: 32 KiB blocks; records carry crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # the rest of a block too small for a header is padding
            pos += room
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def read_offline_run(run_file: Path) -> dict[str, Any]:
    """What an offline run recorded: ``run`` (group, job_type, name), ``config``, ``history``,
    ``summary`` and ``artifacts`` (name, type, files)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"run": {}, "config": {}, "history": [], "summary": {}, "artifacts": []}
    for raw in _records(run_file):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out["run"] = {"group": run.run_group, "job_type": run.job_type, "name": run.display_name, "project": run.project}
            out["config"].update({u.key: json.loads(u.value_json) for u in run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "artifact":
            art = record.artifact
            out["artifacts"].append({"name": art.name, "type": art.type, "files": [f.path for f in art.manifest.contents]})
    # wandb stores config values as {"value": v} (plus its own "_wandb" entry)
    out["config"] = {k: v.get("value") if isinstance(v, dict) and "value" in v else v
                     for k, v in out["config"].items() if k != "_wandb"}
    return out


def load(
    sources: list[str], summaries: Mapping[str, list[dict[str, Any]]] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every source: ``wandb:entity/project/group`` or a local directory; ``summaries``: the local
    sources' summaries by source, already loaded (load_summaries), else each directory is searched."""

    def local(source: str) -> tuple[pd.DataFrame, pd.DataFrame]:
        return load_local([Path(source)], None if summaries is None else summaries[source])

    frames = [load_wandb(s[len("wandb:") :]) if s.startswith("wandb:") else local(s) for s in sources]
    runs = pd.concat([f[0] for f in frames], ignore_index=True) if frames else pd.DataFrame()
    steps = pd.concat([f[1] for f in frames], ignore_index=True) if frames else pd.DataFrame()
    return runs, steps
