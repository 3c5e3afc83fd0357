"""``report.md``: the tables behind the figures, in Markdown."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from testbed.results.format import markdown_table

SCALING_COLUMNS = {
    "option": "sync", "setting": "setting", "world_size": "n", "repeats": "repeats", "throughput": "samples/s", "throughput_std": "± std",
    "throughput_lo": "95 % lo", "throughput_hi": "95 % hi", "verdict": "at this n",
    "speedup": "speed-up", "efficiency": "efficiency", "efficiency_common": "efficiency (common n=1)",
    "marginal_speedup": "marginal speed-up", "imbalance": "imbalance", "idle_fraction": "idle",
}


def write_report(
    out: Path, sources: list[str], runs: pd.DataFrame, table: pd.DataFrame, figures: list[Path],
    breakdown: pd.DataFrame, target_loss: float, sections: Sequence[str] = (),
) -> Path:
    failed = runs[runs["status"] != "ok"]
    parts = [
        "# Report",
        "",
        f"Sources: {', '.join(sources)}. {len(runs)} runs, {len(failed)} failed.",
        "",
        "Efficiency is X(n) / (n X(1)) against the single-worker runs of the same configuration; "
        "'common n=1' uses the fastest single-worker run of the same setting under any synchronizer. "
        "Marginal speed-up is the speed-up gained per worker added since the next smaller world size. "
        "Repeats (seeds) give each point its mean and the 95 % t interval of the mean; at each n the fastest "
        "configuration of a setting is 'best', and those whose interval overlaps its interval are 'tie' (a "
        "single run has no interval and ties with everything). One worker that moves no bytes runs the same "
        "computation under every synchronizer, so those runs are pooled into one point.",
        "",
        "## Scaling",
        "",
        markdown_table(table, SCALING_COLUMNS) if not table.empty else "No successful runs.",
        "",
        "## Per-step breakdown (median ms)",
        "",
        markdown_table(breakdown, {c: c.removeprefix("t_") for c in breakdown.columns if c != "overrides"}),
        "",
    ]
    if "time_to_target" in runs.columns and runs["time_to_target"].notna().any():
        ok = runs[runs["status"] == "ok"].sort_values(["option", "setting", "world_size"])
        parts += [
            f"## Time to a target loss ({target_loss:.4g}, rank 0's loss averaged over 5 steps)",
            "",
            markdown_table(ok, {"option": "sync", "setting": "setting", "world_size": "n", "seed": "seed",
                                "time_to_target": "seconds", "final_loss": "final loss"}),
            "",
        ]
    parts += [s for s in sections if s]
    if not failed.empty:
        parts += ["## Failed runs", "", markdown_table(failed, {"option": "sync", "world_size": "n", "source": "job"}), ""]
    parts += ["## Figures", ""] + [f"- [{p.name}]({p.name})" for p in figures if p.suffix == ".png"] + [""]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path
