"""Staleness against accuracy (Dai et al. 2019): held-out accuracy at equal samples per SSP bound,
and fully asynchronous, for each optimizer, over the seeds.

Reads the summaries of parameter-server runs in ``ssp`` and ``async`` mode: their final held-out
accuracy (every worker ran the same steps, so the runs saw equal samples), the staleness their
pushes measured (the mean of the staleness histogram), and the optimizer. Each point is the mean
over the seeds with its 95 % interval; a drop from one bound to the next inside the intervals is a
tie, never a finding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from analysis.figures import _save  # noqa: E402
from analysis.stats import cell, point  # noqa: E402
from testbed.results.format import markdown_table  # noqa: E402

ASYNC = math.inf  # where asynchronous training sits on the bound's axis: no bound


def optimizer_of(cfg: dict[str, Any]) -> str:
    optim = cfg.get("optim") or {}
    if optim.get("name") == "sgd":
        return "SGD + momentum" if float(optim.get("momentum") or 0.0) > 0 else "SGD"
    return "Adam" if optim.get("name") == "adamw" else str(optim.get("name"))


def points(summaries: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, list[float]]]:
    """(optimizer, bound) -> the seeds' final accuracies and measured mean staleness."""
    out: dict[tuple[str, float], dict[str, list[float]]] = defaultdict(lambda: {"accuracy": [], "staleness": []})
    for summary in summaries:
        cfg = summary.get("config") or {}
        sync = cfg.get("sync") or {}
        final = (summary.get("eval") or {}).get("final") or {}
        if summary.get("status") != "ok" or sync.get("name") != "ps" or sync.get("mode") not in ("ssp", "async"):
            continue
        if "accuracy" not in final:
            continue
        bound = float(sync["staleness"]) if sync["mode"] == "ssp" else ASYNC
        key = (optimizer_of(cfg), bound)
        out[key]["accuracy"].append(float(final["accuracy"]))
        histogram = summary.get("staleness_histogram") or []
        if histogram:
            out[key]["staleness"].append(sum(s * c for s, c in enumerate(histogram)) / sum(histogram))
    return out


def _bound_label(bound: float) -> str:
    return "async" if bound == ASYNC else f"{bound:g}"


def figure(by: dict[tuple[str, float], dict[str, list[float]]], out: Path) -> list[Path]:
    bounds = sorted({b for _, b in by})
    x = {b: i for i, b in enumerate(bounds)}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, optimizer in enumerate(sorted({o for o, _ in by})):
        rows = [(b, point(by[(optimizer, b)]["accuracy"])) for b in bounds if (optimizer, b) in by]
        xs = [x[b] for b, _ in rows]
        means = [p["mean"] for _, p in rows]
        low = [0.0 if math.isnan(p["lo"]) else p["mean"] - p["lo"] for _, p in rows]
        high = [0.0 if math.isnan(p["hi"]) else p["hi"] - p["mean"] for _, p in rows]
        ax.errorbar(xs, means, yerr=[low, high], capsize=3, marker="o", color=f"C{i}", label=optimizer)
    ax.set_xticks(range(len(bounds)), [_bound_label(b) for b in bounds])
    ax.set_xlabel("SSP staleness bound s")
    ax.set_ylabel("final held-out accuracy (mean, 95 % interval)")
    ax.set_title("accuracy at equal samples against staleness")
    ax.legend(fontsize=8)
    return _save(fig, out, "staleness")


def table(by: dict[tuple[str, float], dict[str, list[float]]]) -> str:
    rows = []
    for optimizer in sorted({o for o, _ in by}):
        for bound in sorted(b for o, b in by if o == optimizer):
            values = by[(optimizer, bound)]
            rows.append({"optimizer": optimizer, "bound s": _bound_label(bound), "seeds": len(values["accuracy"]),
                         "mean staleness": cell(values["staleness"], 2), "accuracy": cell(values["accuracy"], 3)})
    return markdown_table(rows)


def trend(by: dict[tuple[str, float], dict[str, list[float]]]) -> list[str]:
    """Per optimizer: the drop from the tightest bound to the loosest (asynchronous), and whether the
    intervals of the two ends are apart."""
    lines = []
    for optimizer in sorted({o for o, _ in by}):
        bounds = sorted(b for o, b in by if o == optimizer)
        first, last = point(by[(optimizer, bounds[0])]["accuracy"]), point(by[(optimizer, bounds[-1])]["accuracy"])
        apart = last["hi"] < first["lo"] if math.isfinite(first["lo"]) and math.isfinite(last["hi"]) else False
        lines.append(f"- {optimizer}: {first['mean']:.3f} at s = {_bound_label(bounds[0])}, {last['mean']:.3f} at "
                     f"{_bound_label(bounds[-1])} ({'a drop outside the intervals' if apart else 'inside the intervals: a tie'})")
    return lines


def analyse(summaries: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """The staleness figure and report section; nothing without SSP or asynchronous runs of more than one bound."""
    by = points(summaries)
    if len({b for _, b in by}) < 2:
        return [], ""
    written = figure(by, out)
    section = "\n".join(["## Staleness against accuracy", "",
                         "Final held-out accuracy at equal samples per SSP bound (and asynchronous), mean over the "
                         "seeds with its 95 % interval; the measured mean staleness of the pushes beside.", "",
                         table(by), "", *trend(by), ""])
    return written, section
