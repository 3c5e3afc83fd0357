"""The two-level figure and table: throughput, and what crossed each machine's uplink, per synchronizer.

Runs on a two-level emulated network (``network.nodes``) carry ``topology`` in ``summary.json``: the
machine of every rank and server, and the bytes each machine's uplink sent and received over the
whole run, from the kernel's counters. Per step here is that total over the run's steps, so set-up
(the initial parameters, the servers' sizes) is spread over the steps it preceded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save  # noqa: E402
from testbed.netem import parse_rate  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402


def _per_step(summary: dict[str, Any], machines: set[int], way: str) -> list[float]:
    """Bytes per step each of ``machines``' uplinks carried ``way`` (sent or received)."""
    counters, steps = summary["topology"]["uplink_bytes"], int(summary["steps_configured"])
    return [counters[str(m)][way] / steps for m in sorted(machines)]


def table(summaries: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per ok two-level run: its link, synchronizer, throughput, and the mean bytes per step
    through a worker machine's uplink and the busiest server machine's, in gradients (M) too."""
    rows = []
    for s in summaries:
        topology = s.get("topology")
        if s.get("status") != "ok" or not topology or s.get("simulated"):
            continue
        ranks = {m for endpoint, m in topology["machines"].items() if endpoint.startswith("r")}
        grad = float(s["gradient_bytes"])
        servers = set(topology["machines"].values()) - ranks
        node_out = float(np.mean(_per_step(s, ranks, "sent")))
        node_in = float(np.mean(_per_step(s, ranks, "received")))
        server = max(_per_step(s, servers, "received"), default=0.0)
        rows.append({"link": topology["bandwidth"], "sync": s.get("sync_label") or s["sync"], "n": s["world_size"], "nodes": len(ranks),
                     "throughput": s["throughput"], "node_out_mb": node_out / 1e6, "node_in_mb": node_in / 1e6,
                     "node_out_m": node_out / grad, "server_in_mb": server / 1e6 if servers else np.nan,
                     "gradient_mb": grad / 1e6})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    ring = frame[frame["sync"] == "ring"].set_index("link")["throughput"]
    frame["vs_ring"] = frame["throughput"] / frame["link"].map(ring)
    return frame.sort_values(["link", "sync"]).reset_index(drop=True)


def _figure(frame: pd.DataFrame, out: Path) -> list[Path]:
    links = sorted(frame["link"].unique(), key=parse_rate, reverse=True)
    syncs = sorted(frame["sync"].unique())
    fig, axes = plt.subplots(2, len(links), figsize=(4.6 * len(links), 6.4), squeeze=False)
    for col, link in enumerate(links):
        g = frame[frame["link"] == link].set_index("sync").reindex(syncs)
        x = np.arange(len(syncs))
        axes[0][col].bar(x, g["throughput"], color=[f"C{i}" for i in range(len(syncs))])
        axes[0][col].set(title=f"{int(g['nodes'].max())} machines, {link} between them", ylabel="samples/s" if col == 0 else None)
        axes[1][col].bar(x - 0.2, g["node_out_m"], 0.4, color="C0", label="a worker machine's uplink, out")
        axes[1][col].bar(x + 0.2, g["server_in_mb"] / g["gradient_mb"], 0.4, color="C1", label="busiest server machine's, in")
        axes[1][col].set(ylabel="gradients (M) per step" if col == 0 else None)
        for row in range(2):
            axes[row][col].set_xticks(x, syncs, rotation=35, ha="right", fontsize=8)
            axes[row][col].grid(axis="y", alpha=0.3)
    axes[1][0].legend(fontsize=7)
    return _save(fig, out, "topology")


def analyse(summaries: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """The figure and report section, where runs were on two-level networks (else nothing)."""
    frame = table(summaries)
    if frame.empty:
        return [], ""
    columns = {"link": "between machines", "sync": "sync", "n": "n", "nodes": "machines", "throughput": "samples/s",
               "vs_ring": "vs ring", "node_out_mb": "node uplink out MB/step", "node_in_mb": "in MB/step",
               "node_out_m": "out, in M", "server_in_mb": "server uplink in MB/step"}
    section = "\n".join([
        "## Two levels", "",
        "What crossed the machines' uplinks per step (the kernel's counters over the run, set-up spread over its "
        "steps; M = the gradient), and throughput against the flat ring on the same link.", "",
        markdown_table(frame, columns), "",
    ])
    return _figure(frame, out), section
