"""Figures from the aggregated frames, each written as PNG and PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and in CI

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.metrics import breakdown  # noqa: E402


def _save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def _series(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One line per configuration, named by its sync option, plus the rest of its overrides where
    the option alone does not tell the lines apart."""
    groups = list(table.groupby("config_key", dropna=False))
    names = [str(group["option"].iloc[0]) for _, group in groups]
    out = []
    for name, (_, group) in zip(names, groups):
        setting = str(group["setting"].iloc[0])
        label = f"{name} ({setting})" if names.count(name) > 1 and setting else name
        out.append((label, group.sort_values("world_size")))
    return sorted(out, key=lambda item: item[0])


def _style(labels: list[str]) -> dict[str, dict]:
    """A color per synchronizer; its simulated series dashed in the same color as the measured one."""
    bases = sorted({label.replace(" (simulated)", "") for label in labels})
    colors = {b: f"C{i % 10}" for i, b in enumerate(bases)}
    return {label: {"color": colors[label.replace(" (simulated)", "")], "ls": "--" if "(simulated)" in label else "-",
                    "marker": "." if "(simulated)" in label else "o"} for label in labels}


def _workers_axis(ax: plt.Axes, ns: list[int]) -> None:
    """Workers on a log2 axis when they span a wide range (a simulated sweep), else linear; the
    limits from the workers themselves, so that a panel with no finite value still draws."""
    if max(ns) / min(ns) >= 16:
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(ns) / 1.25, max(ns) * 1.25)
    ax.set_xticks(ns, [str(n) for n in ns], fontsize=7 if len(ns) > 8 else None)


def _no_baseline(ax: plt.Axes, values: pd.Series) -> None:
    """Say so in a panel whose measure needs a world_size=1 run the sweep does not have."""
    if values.isna().all():
        ax.text(0.5, 0.5, "no world_size=1 run to measure against", transform=ax.transAxes, ha="center", va="center")


def scaling(table: pd.DataFrame, out: Path) -> list[Path]:
    """Figure 1: scaling efficiency and throughput against workers, one line per synchronizer.

    Efficiency is against the fastest single worker of the same setting (``efficiency_common``),
    so a parameter server's own n = 1 round trip does not flatter it."""
    fig, (ax_e, ax_x) = plt.subplots(1, 2, figsize=(10, 4))
    series = _series(table)
    styles = _style([label for label, _ in series])
    for label, g in series:
        style = styles[label]
        ax_e.errorbar(g["world_size"], g["efficiency_common"], yerr=g["efficiency_std"], capsize=3, label=label, **style)
        ax_x.errorbar(g["world_size"], g["throughput"], yerr=g["throughput_std"], capsize=3, label=label, **style)
    for _key, g in table.groupby("setting_key", dropna=False):  # the ideal: n times the best single worker
        single = g[g["world_size"] == 1]["throughput"]
        if not single.empty:
            ns = sorted(g["world_size"].unique())
            ax_x.plot(ns, [n * single.max() for n in ns], ":", color="k", lw=0.8)
    ns = sorted(table["world_size"].unique())
    ax_e.set(xlabel="workers", ylabel="scaling efficiency X(n) / (n X(1))", ylim=(0, 1.05))
    ax_x.set(xlabel="workers", ylabel="throughput (samples/s); dotted: n X(1)")
    if max(ns) / min(ns) >= 16:
        ax_x.set_yscale("log")
    else:
        ax_x.set_ylim(bottom=0)
    for ax in (ax_e, ax_x):
        _workers_axis(ax, ns)
        ax.grid(alpha=0.3)
    _no_baseline(ax_e, table["efficiency_common"])
    ax_e.legend(fontsize=7)
    return _save(fig, out, "scaling")


KNEE = 0.5  # marginal speed-up per added worker that marks the knee


def diminishing_returns(table: pd.DataFrame, out: Path) -> list[Path]:
    """Figure 8: speed-up and the marginal speed-up per added worker."""
    fig, (ax_s, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    series = _series(table)
    styles = _style([label for label, _ in series])
    for label, g in series:
        ax_s.errorbar(g["world_size"], g["speedup"], yerr=g["speedup_std"], capsize=3, label=label, **styles[label])
        ax_m.plot(g["world_size"], g["marginal_speedup"], label=label, **styles[label])
        knee = g[g["marginal_speedup"] < KNEE]
        if not knee.empty:  # where an added worker starts to bring less than half a worker's speed
            ax_m.plot(knee["world_size"].iloc[0], knee["marginal_speedup"].iloc[0], "x", color=styles[label]["color"], ms=10, mew=2)
    ns = sorted(table["world_size"].unique())
    ax_s.plot(ns, ns, "k:", lw=0.8, label="linear")
    ax_m.axhline(0.0, color="k", lw=0.8)
    ax_s.set(xlabel="workers", ylabel="speed-up S(n)")
    ax_m.set(xlabel="workers", ylabel="marginal speed-up per added worker", title=f"x: the knee (below {KNEE})")
    if max(ns) / min(ns) >= 16 and table["speedup"].notna().any():
        ax_s.set_yscale("log", base=2)
    _no_baseline(ax_s, table["speedup"])
    _no_baseline(ax_m, table["marginal_speedup"])
    for ax in (ax_s, ax_m):
        _workers_axis(ax, ns)
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    return _save(fig, out, "diminishing_returns")


PANELS = {  # measure: (axis label, scale to display units)
    "step_time": ("step time (ms)", 1e3),
    "throughput": ("throughput (samples/s)", 1.0),
    "idle_fraction": ("idle fraction (waiting for peers)", 1.0),
    "time_to_target": ("time to target loss (s)", 1.0),
    "eval_accuracy": ("final held-out accuracy", 1.0),
}


def versus(table: pd.DataFrame, key: str, out: Path) -> list[Path]:
    """Step time and throughput against a swept override (bucket size, accumulation, slowdown, ...),
    plus idle fraction and time to the target loss where the runs differ in them."""
    name = key.removeprefix("set:")
    measures = [m for m in PANELS if m in table.columns and (m in ("step_time", "throughput") or table[m].abs().sum() > 0)]
    fig, axes = plt.subplots(1, len(measures), figsize=(5 * len(measures), 4))
    for (sync, series, n), g in table.groupby(["option", "series", "world_size"]):
        g = g.sort_values(key)
        label = f"{sync}, n={n}" + (f" ({series})" if table["series"].nunique() > 1 else "")
        for ax, m in zip(axes, measures):
            scale = PANELS[m][1]
            ax.errorbar(g[key], scale * g[m], yerr=scale * g[f"{m}_std"], marker="o", capsize=3, label=label)
    for ax, m in zip(axes, measures):
        ax.set(xlabel=name, ylabel=PANELS[m][0], ylim=(0, None))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out, f"vs_{name.replace('.', '_')}")


def convergence(curves: pd.DataFrame, target: float, out: Path) -> list[Path]:
    """Figures 6 and 7: rank 0's smoothed loss against wall-clock time, one line per run, at the
    largest world size of the sweep; the dashed line is the target of the time-to-target measure."""
    n = curves["world_size"].max()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for _source, g in curves[curves["world_size"] == n].groupby("source"):
        label = f"{g['option'].iloc[0]} {g['setting'].iloc[0]}".strip()
        ax.plot(g["time"], g["smoothed"], lw=1.2, label=label)
    ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.3g}")
    ax.set(xlabel="wall-clock time (s)", ylabel="training loss (rank 0, smoothed)", title=f"n = {n}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out, "loss_vs_time")


def step_breakdown(runs: pd.DataFrame, out: Path) -> list[Path]:
    """Figure 4 style: stacked median phase times per run (sync split into wait and transfer)."""
    frame = breakdown(runs).sort_values(["option", "world_size", "overrides"])
    phases = [c for c in ("t_data", "t_injected", "t_forward", "t_backward", "t_encode", "t_transfer", "t_decode", "t_wait",
                          "t_optimizer")
              if c in frame.columns]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(frame) + 2), 4.5))
    bottom = pd.Series(0.0, index=frame.index)
    for phase in phases:
        ax.bar(range(len(frame)), frame[phase], bottom=bottom, label=phase.removeprefix("t_"))
        bottom += frame[phase]
    labels = [_short_label(r) for _, r in frame.iterrows()]
    ax.set_xticks(range(len(frame)), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="median time per step (ms)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out, "breakdown")


def _short_label(row: pd.Series) -> str:
    keep = [o for o in str(row["overrides"]).split(",") if o and not o.startswith(("+experiment", "sync=", "world_size=",
                                                                                     "device=", "launcher.", "hydra.", "sweep_resume="))]
    return f"{row['option']} n={row['world_size']}" + (f" {' '.join(keep)}" if keep else "")
