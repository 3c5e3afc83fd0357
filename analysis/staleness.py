"""Staleness against accuracy (Dai et al. 2019): held-out accuracy at equal samples per staleness,
as an SSP bound (and fully asynchronous) and as a fixed delay, for each optimizer, over the seeds.

Reads the summaries of parameter-server runs in ``ssp`` and ``async`` mode and of virtual runs with
``launcher.fixed_delay``: their final held-out accuracy (every worker ran the same steps, so the
runs saw equal samples), the staleness their gradients measured (the mean of the staleness
histogram), and the optimizer. Each point is the mean over the seeds with its 95 % interval; a drop
from one staleness to the next inside the intervals is a tie, never a finding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.stats import cell, point  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402

ASYNC = math.inf  # where asynchronous training sits on the bound's axis: no bound
COLUMNS = {"optimizer": "optimizer", "kind": "staleness as", "s": "s", "seeds": "seeds",
           "staleness": "mean staleness measured", "accuracy": "final held-out accuracy"}


def optimizer_of(cfg: dict[str, Any]) -> str:
    optim = cfg.get("optim") or {}
    if optim.get("name") == "sgd":
        return "SGD + momentum" if float(optim.get("momentum") or 0.0) > 0 else "SGD"
    return "Adam" if optim.get("name") == "adamw" else str(optim.get("name"))


def points(summaries: list[dict[str, Any]]) -> dict[tuple[str, str, float], dict[str, list[float]]]:
    """(optimizer, "SSP" or "fixed delay", staleness) -> the seeds' final accuracies and measured
    mean staleness."""
    out: dict[tuple[str, str, float], dict[str, list[float]]] = defaultdict(lambda: {"accuracy": [], "staleness": []})
    for summary in summaries:
        cfg = summary.get("config") or {}
        sync, delay = cfg.get("sync") or {}, (cfg.get("launcher") or {}).get("fixed_delay")
        final = (summary.get("eval") or {}).get("final") or {}
        if summary.get("status") != "ok" or "accuracy" not in final:
            continue
        if sync.get("name") == "ps" and sync.get("mode") in ("ssp", "async"):
            key = (optimizer_of(cfg), "SSP", float(sync["staleness"]) if sync["mode"] == "ssp" else ASYNC)
        elif delay is not None:
            key = (optimizer_of(cfg), "fixed delay", float(delay))
        else:
            continue
        out[key]["accuracy"].append(float(final["accuracy"]))
        histogram = summary.get("staleness_histogram") or []
        if histogram:
            out[key]["staleness"].append(sum(s * c for s, c in enumerate(histogram)) / sum(histogram))
    return out


def _bound_label(bound: float) -> str:
    return "async" if bound == ASYNC else f"{bound:g}"


def figure(by: dict[tuple[str, str, float], dict[str, list[float]]], out: Path) -> list[Path]:
    kinds = sorted({k for _, k, _ in by}, reverse=True)  # SSP, then fixed delay
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        bounds = sorted({b for _, k, b in by if k == kind})
        x = {b: i for i, b in enumerate(bounds)}
        for i, optimizer in enumerate(sorted({o for o, _, _ in by})):
            rows = [(b, point(by[(optimizer, kind, b)]["accuracy"])) for b in bounds if (optimizer, kind, b) in by]
            if not rows:
                continue
            low = [0.0 if math.isnan(p["lo"]) else p["mean"] - p["lo"] for _, p in rows]
            high = [0.0 if math.isnan(p["hi"]) else p["hi"] - p["mean"] for _, p in rows]
            ax.errorbar([x[b] for b, _ in rows], [p["mean"] for _, p in rows], yerr=[low, high], capsize=3,
                        marker="o", color=f"C{i}", label=optimizer)
        ax.set_xticks(range(len(bounds)), [_bound_label(b) for b in bounds])
        ax.set_xlabel("SSP staleness bound s" if kind == "SSP" else "fixed delay s (steps)")
        ax.set_title(f"staleness as {'an SSP bound' if kind == 'SSP' else 'a fixed delay'}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final held-out accuracy (mean, 95 % interval)")
    return _save(fig, out, "staleness")


def table(by: dict[tuple[str, str, float], dict[str, list[float]]]) -> str:
    rows = []
    for optimizer, kind, bound in sorted(by, key=lambda k: (k[0], k[1] != "SSP", k[2])):
        values = by[(optimizer, kind, bound)]
        rows.append({"optimizer": optimizer, "kind": kind, "s": _bound_label(bound), "seeds": len(values["accuracy"]),
                     "staleness": cell(values["staleness"], 2), "accuracy": cell(values["accuracy"], 3)})
    return markdown_table(pd.DataFrame(rows), COLUMNS)


def trend(by: dict[tuple[str, str, float], dict[str, list[float]]]) -> list[str]:
    """Per optimizer and kind: the accuracy at the least and the most staleness, and whether the
    intervals of the two ends are apart."""
    lines = []
    for optimizer, kind in sorted({(o, k) for o, k, _ in by}):
        bounds = sorted(b for o, k, b in by if (o, k) == (optimizer, kind))
        first = point(by[(optimizer, kind, bounds[0])]["accuracy"])
        last = point(by[(optimizer, kind, bounds[-1])]["accuracy"])
        apart = last["hi"] < first["lo"] if math.isfinite(first["lo"]) and math.isfinite(last["hi"]) else False
        lines.append(f"- {optimizer}, {kind}: {first['mean']:.3f} at s = {_bound_label(bounds[0])}, {last['mean']:.3f} "
                     f"at s = {_bound_label(bounds[-1])} ({'a drop outside the intervals' if apart else 'a tie'})")
    return lines


def analyse(summaries: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """The staleness figure and report section; nothing without SSP or asynchronous runs of more than one bound."""
    by = points(summaries)
    if len({(k, b) for _, k, b in by}) < 2:
        return [], ""
    written = figure(by, out)
    section = "\n".join(["## Staleness against accuracy", "",
                         "Final held-out accuracy at equal samples per staleness (an SSP bound, or asynchronous; a "
                         "fixed delay), mean over the seeds with its 95 % interval; the measured mean staleness "
                         "beside.", "",
                         table(by), "", *trend(by), ""])
    return written, section
