"""The compression figure and table: every codec against no codec, under each synchronizer.

Measured sweeps (a few world sizes) get grouped bars per (setting, n): throughput, and time to the
target loss and final loss where the runs record losses. Simulated sweeps over many world sizes
get the speed-up of each codec over the same synchronizer uncompressed, against workers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save, _workers_axis  # noqa: E402
from testbed.compress import CODECS  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402

ORDER = ["none", *sorted(c for c in CODECS if c != "none")]
MEASURES = {"throughput": "samples/s", "time_to_target": "time to target loss (s)", "final_loss": "final loss"}


def codec_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The ok runs with their synchronizer option and codec apart (from ``option``: 'ring+topk')."""
    ok = runs[runs["status"] == "ok"].copy()
    option = ok["option"].str.replace(" (simulated)", "", regex=False)
    parts = option.str.partition("+")  # columns: before, "+", after ("" without a codec)
    ok["sync_option"] = parts[0]
    ok["codec"] = parts[2].replace("", "none")
    return ok


def table(runs: pd.DataFrame) -> pd.DataFrame:
    """Means over repeats per (setting, n, synchronizer, codec), and the speed-up over the same
    synchronizer without a codec at the same setting and n."""
    ok = codec_runs(runs)
    keys = ["setting", "world_size", "sync_option", "codec"]
    measures = [m for m in MEASURES if m in ok.columns]
    grouped = ok.groupby(keys, dropna=False)
    out = grouped[measures].mean()
    out["throughput_std"] = grouped["throughput"].std().fillna(0.0)
    out["repeats"] = grouped.size()
    out = out.reset_index()
    plain = out[out["codec"] == "none"].set_index(["setting", "world_size", "sync_option"])["throughput"]
    index = pd.MultiIndex.from_frame(out[["setting", "world_size", "sync_option"]])
    out["speedup"] = out["throughput"].to_numpy() / plain.reindex(index).to_numpy()
    out["codec"] = pd.Categorical(out["codec"], [c for c in ORDER if c in set(out["codec"])], ordered=True)
    return out.sort_values(keys).reset_index(drop=True)


def _bars(frame: pd.DataFrame, out: Path) -> list[Path]:
    measures = [m for m in MEASURES if m in frame.columns and frame[m].notna().any()]
    panels = list(frame.groupby(["setting", "world_size"], sort=True))
    syncs = sorted(frame["sync_option"].unique())
    codecs = list(frame["codec"].cat.categories)
    fig, axes = plt.subplots(len(measures), len(panels), figsize=(4.2 * len(panels), 3.2 * len(measures)), squeeze=False)
    width = 0.8 / len(syncs)
    for col, ((setting, n), g) in enumerate(panels):
        for row, m in enumerate(measures):
            ax = axes[row][col]
            for i, sync in enumerate(syncs):
                s = g[g["sync_option"] == sync].set_index("codec").reindex(codecs)
                x = np.arange(len(codecs)) + (i - (len(syncs) - 1) / 2) * width
                err = s["throughput_std"] if m == "throughput" else None
                ax.bar(x, s[m], width, yerr=err, capsize=2, color=f"C{i}", label=sync)
            ax.set_xticks(range(len(codecs)), codecs, rotation=45, ha="right", fontsize=8)
            ax.set(ylabel=MEASURES[m] if col == 0 else None)
            if m == "throughput":
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
            if row == 0:
                ax.set_title(f"{setting or 'default'}, n = {n}", fontsize=9)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out, "compression")


def _speedups(frame: pd.DataFrame, out: Path) -> list[Path]:
    settings, syncs = sorted(frame["setting"].unique()), sorted(frame["sync_option"].unique())
    fig, axes = plt.subplots(len(syncs), len(settings), figsize=(4.2 * len(settings), 3.2 * len(syncs)),
                             squeeze=False, sharey=True)
    ns = sorted(frame["world_size"].unique())
    for col, setting in enumerate(settings):
        for row, sync in enumerate(syncs):
            ax = axes[row][col]
            g = frame[(frame["setting"] == setting) & (frame["sync_option"] == sync)]
            for i, codec in enumerate(frame["codec"].cat.categories):
                c = g[g["codec"] == codec].sort_values("world_size")
                if not c.empty:
                    ax.plot(c["world_size"], c["speedup"], marker="o", ms=3, color=f"C{i}", label=str(codec))
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_yscale("log", base=2)  # slow-downs and speed-ups of 70x alike
            _workers_axis(ax, ns)
            ax.set(title=f"{sync}: {setting or 'default'}", xlabel="workers" if row == len(syncs) - 1 else None,
                   ylabel="speed-up over no codec" if col == 0 else None)
            ax.title.set_fontsize(8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    return _save(fig, out, "compression")


def analyse(runs: pd.DataFrame, out: Path) -> tuple[list[Path], str]:
    """The figure and report section, where the runs compare codecs (else nothing)."""
    ok = codec_runs(runs)
    if ok.empty or ok["codec"].nunique() < 2:
        return [], ""
    frame = table(runs)
    figures = _speedups(frame, out) if frame["world_size"].nunique() > 2 else _bars(frame, out)
    columns = {"setting": "setting", "world_size": "n", "sync_option": "sync", "codec": "codec", "repeats": "repeats",
               "throughput": "samples/s", "throughput_std": "± std", "speedup": "speed-up vs none"}
    columns.update({m: label for m, label in (("time_to_target", "time to target (s)"), ("final_loss", "final loss"))
                    if m in frame.columns and frame[m].notna().any()})
    section = "\n".join([
        "## Compression", "",
        "Each codec against the same synchronizer without one (speed-up in throughput), at each setting and n.", "",
        markdown_table(frame.astype({"codec": str}), columns), "",
    ])
    return figures, section
