"""Figure 9: the simulator's predicted step time against the measured one (testbed.sim.validate),
and measured scaling beside the prediction from single-worker compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.load import QUIET  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402
from testbed.sim.validate import geometric_error  # noqa: E402


def scored(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows whose prediction counts: predicted runs that communicate."""
    frame = pd.DataFrame(rows)
    return frame[frame["predicted"].notna() & (frame["note"] == "")]


def errors(frame: pd.DataFrame) -> pd.DataFrame:
    """Geometric-mean and worst relative error per synchronizer, and over all; also for the
    predictions from single-worker compute where there are any."""
    out = []
    for option, g in [*frame.groupby("option"), ("all", frame)]:
        pairs = list(zip(g["predicted"], g["measured"]))
        single = [(p, m) for p, m in zip(g["predicted_single"], g["measured"]) if p == p]
        out.append({"option": option, "points": len(g), "gm_error": 100 * geometric_error(pairs),
                    "worst": 100 * max(abs(p / m - 1) for p, m in pairs),
                    "gm_single": 100 * geometric_error(single) if single else float("nan")})
    return pd.DataFrame(out)


def draw(frame: pd.DataFrame, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6, 5.5))
    per_option = errors(frame).set_index("option")["gm_error"]
    for option, g in frame.groupby("option"):
        ax.scatter(1e3 * g["measured"], 1e3 * g["predicted"], label=f"{option} (GM error {per_option[option]:.1f} %)", s=22)
    lo = 1e3 * min(frame["measured"].min(), frame["predicted"].min()) * 0.8
    hi = 1e3 * max(frame["measured"].max(), frame["predicted"].max()) * 1.25
    line = np.geomspace(lo, hi, 50)
    ax.plot(line, line, "k-", lw=0.8, label="y = x")
    ax.fill_between(line, 0.9 * line, 1.1 * line, color="k", alpha=0.1, label="±10 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (ms)",
           ylabel="predicted step time (ms)", title="Simulator validation")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000) if lo <= t <= hi]
    for axis in (ax.xaxis, ax.yaxis):  # plain milliseconds, no labels on minor ticks
        axis.set_ticks(ticks, [str(t) for t in ticks])
        axis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, out, "validation")


def draw_scaling(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Measured throughput and efficiency against workers (solid) beside the simulator's prediction
    of the same configs from the single worker's compute (dashed), one row of panels per setting
    (model); efficiency is against the measured best single worker of the setting."""
    frame = pd.DataFrame(rows)
    frame = frame[frame["predicted_single"].notna()]
    settings = sorted(frame["setting"].unique()) if not frame.empty else []
    if not settings or frame["world_size"].nunique() < 2:
        return []
    fig, axes = plt.subplots(len(settings), 2, figsize=(10, 3.8 * len(settings)), squeeze=False)
    colors = dict(zip(sorted(frame["option"].unique()), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for (ax_x, ax_e), setting in zip(axes, settings):
        g = frame[frame["setting"] == setting]
        best = (g["global_batch"] / g["measured"])[g["world_size"] == 1].max()
        for option, s in g.groupby("option"):
            s = s.groupby("world_size").agg({"global_batch": "first", "measured": "median", "predicted_single": "median"})
            measured, predicted = s["global_batch"] / s["measured"], s["global_batch"] / s["predicted_single"]
            for series, style in ((measured, "-o"), (predicted, "--x")):
                ax_x.plot(s.index, series, style, color=colors[option], label=option if style == "-o" else None)
                ax_e.plot(s.index, series / (s.index * best), style, color=colors[option])
        title = ",".join(o for o in setting.split(",") if not o.startswith(QUIET)) or "all runs"
        ax_x.set(xlabel="workers", ylabel="throughput (samples/s)", title=title, ylim=(0, None))
        ax_e.set(xlabel="workers", ylabel="efficiency X(n) / (n X(1))", ylim=(0, 1.05), title=title)
        for ax in (ax_x, ax_e):
            ax.set_xticks(sorted(g["world_size"].unique()))
            ax.grid(alpha=0.3)
        ax_x.legend(fontsize=7)
    fig.suptitle("measured (solid) and simulated from the single worker's compute (dashed)")
    fig.tight_layout()
    return _save(fig, out, "predicted_scaling")


def report_section(rows: list[dict[str, Any]]) -> str:
    frame = pd.DataFrame(rows)
    ok = scored(rows)
    parts = ["## Simulator validation", "",
             "Predicted from each run's config and the calibration's link fits, with the compute of the run's own step "
             "log (figure 9; what extrapolation relies on), and with the compute of a single-worker run of the same "
             "setting slowed by ranks sharing the cores (adds this machine's contention). Runs without communication "
             "are listed but not scored.", ""]
    if not ok.empty:
        parts += [markdown_table(errors(ok), {"option": "sync", "points": "points", "gm_error": "GM error %",
                                              "worst": "worst error %",
                                              "gm_single": "GM error % (single-worker compute)"}), ""]
    frame = frame.assign(measured_ms=1e3 * frame["measured"], predicted_ms=1e3 * frame["predicted"],
                         single_ms=1e3 * frame["predicted_single"])
    frame["error"] = 100 * (frame["predicted"] / frame["measured"] - 1)
    parts += [markdown_table(frame.sort_values(["option", "setting", "world_size"]),
                             {"option": "sync", "setting": "setting", "world_size": "n", "measured_ms": "measured ms",
                              "predicted_ms": "predicted ms", "error": "error %",
                              "single_ms": "predicted ms (single-worker compute)", "note": "note"}), ""]
    return "\n".join(parts)


def analyse(rows: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    ok = scored(rows)
    return (draw(ok, out) if not ok.empty else []) + draw_scaling(rows, out), report_section(rows)
