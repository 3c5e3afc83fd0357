"""Console tables: one row per job, with speed-up and scaling efficiency against world_size = 1.

Scaling efficiency is X(n) / (n * X(1)), X the throughput (samples/s) and X(1) that of the
world_size = 1 job of the same configuration in the same table (same config but world_size).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from testbed.results.format import rows_frame, text_table
from testbed.results.keys import run_key

COLUMNS = (
    ("sync", "sync"), ("n", "world_size"), ("status", "status"), ("samples/s", "throughput"), ("tokens/s", "tokens"),
    ("goodput", "goodput"), ("B_simple", "b_simple"),
    ("step ms", "step_ms"), ("sync ms", "sync_ms"), ("wait ms", "wait_ms"), ("imbalance", "imbalance"), ("speedup", "speedup"),
    ("efficiency", "efficiency"), ("MB/step", "mb_per_step"), ("loss", "final_loss"),
)


def _ms(summary: dict[str, Any], phase: str) -> float | None:
    spread = (summary.get("phases") or {}).get(phase)
    return None if not spread or spread.get("median") is None else 1e3 * spread["median"]


def sync_label(summary: dict[str, Any]) -> Any:
    """The synchronizer as rows and dashboards name it (its spec's label, e.g. ps-ssp k=4)."""
    return summary.get("sync_label") or summary.get("sync")


def summary_row(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "sync": sync_label(summary),
        "world_size": summary.get("world_size"),
        "status": summary.get("status"),
        "throughput": summary.get("throughput"),
        # Language models: the field's unit (images/s equal samples/s, so they need no column).
        "tokens": summary.get("throughput_items") if summary.get("throughput_unit") == "tokens/s" else None,
        # stats.noise_scale: throughput × statistical efficiency (Pollux), and the noise scale it used.
        "goodput": (summary.get("noise_scale") or {}).get("goodput"),
        "b_simple": (summary.get("noise_scale") or {}).get("b_simple"),
        "step_ms": None if summary.get("step_time") is None else 1e3 * summary["step_time"],
        "sync_ms": _ms(summary, "t_sync"),
        "wait_ms": _ms(summary, "t_wait"),
        "imbalance": summary.get("imbalance"),
        "mb_per_step": None if summary.get("bytes_per_step") is None else summary["bytes_per_step"] / 1e6,
        "final_loss": summary.get("final_loss"),
    }


def _baseline_key(summary: dict[str, Any]) -> tuple[str, str]:
    """Jobs with equal keys differ only in world_size: the command-line overrides but world_size
    (testbed.results.keys.run_key; the seed stays, so a repeat is compared with the single worker
    of its own seed), or, for summaries without them, the resolved config but world_size and
    run-time server addresses."""
    if "overrides" in summary:
        return "overrides", run_key(summary["overrides"], vary=("world_size=",))
    cfg = dict(summary.get("config") or {})
    cfg.pop("world_size", None)
    cfg["sync"] = {k: v for k, v in (cfg.get("sync") or {}).items() if k != "addresses"}
    return "config", json.dumps(cfg, sort_keys=True, default=str)


def comparison_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by (sync, world_size) with speedup and efficiency against the n = 1 job."""
    single = {
        _baseline_key(s): s["throughput"]
        for s in summaries
        if s.get("world_size") == 1 and s.get("status") == "ok" and s.get("throughput")
    }
    rows = []
    for s in sorted(summaries, key=lambda s: (str(sync_label(s)), s.get("world_size") or 0)):
        row = summary_row(s)
        base = single.get(_baseline_key(s))
        if base and s.get("throughput"):
            row["speedup"] = s["throughput"] / base
            row["efficiency"] = row["speedup"] / s["world_size"]
        rows.append(row)
    return rows


OPTIONAL = ("tokens", "goodput", "b_simple")  # printed only when a row has a value


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows (summary_row, comparison_rows) as a console table (testbed.results.format)."""
    keys = [key for _, key in COLUMNS]
    return text_table(rows_frame(rows, keys), {key: title for title, key in COLUMNS}, optional=OPTIONAL)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for _, key in COLUMNS])
        writer.writeheader()
        writer.writerows({key: row.get(key) for _, key in COLUMNS} for row in rows)
