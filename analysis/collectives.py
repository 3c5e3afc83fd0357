"""Figures 2 and 3: the collective micro-benchmark (nccl-tests style) with its fitted alpha-beta
lines, and the time of one synchronization against the number of workers and server shards.

Reads the JSON records of ``python -m testbed.bench`` and ``python -m testbed.bench.ps``; the fits
are testbed.sim.calibrate's, the same the simulator uses, so the dashed lines show how well the
cost model describes what was measured.
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
from testbed.results.format import markdown_table  # noqa: E402
from testbed.sim.calibrate import FALLBACK_IMPLS, Fit, fit_records, model  # noqa: E402


def draw(records: list[dict[str, Any]], fits: list[Fit], out: Path) -> list[Path]:
    """Time and bus bandwidth against message size, one row of panels per world size."""
    ns = sorted({int(r["world_size"]) for r in records})
    fig, axes = plt.subplots(len(ns), 2, figsize=(11, 3.8 * len(ns)), squeeze=False)
    by_key = {(f.link, f.impl): f for f in fits}
    for row, n in enumerate(ns):
        ax_t, ax_b = axes[row]
        series: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in records:
            if int(r["world_size"]) == n and r.get("correct", True):
                series.setdefault((r["link"], r["impl"]), []).append(r)
        for (link, impl), rows in sorted(series.items()):
            points = _medians(rows)
            sizes = np.array(sorted(points), dtype=float)
            times = np.array([points[s] for s in sorted(points)])
            # Bus bandwidth as the benchmark defines it for this impl (2(n-1)/n for all-reduce, 1 for PS).
            factor = float(rows[0]["busbw"]) / float(rows[0]["algbw"])
            label = impl if len({k[0] for k in series}) == 1 else f"{impl} ({link})"
            (line,) = ax_t.plot(sizes, 1e3 * times, "o-", label=label)
            ax_b.plot(sizes, factor * sizes / times / 1e9, "o-", color=line.get_color())
            fit = by_key.get((link, impl))
            if fit is not None and model(rows[0]) is not None:
                grid = np.geomspace(sizes.min(), sizes.max(), 50)
                predicted = np.array([model({**rows[0], "bytes": s}).time(fit.to_link()) for s in grid])
                ax_t.plot(grid, 1e3 * predicted, "--", color=line.get_color(), lw=0.9)
                ax_b.plot(grid, factor * grid / predicted / 1e9, "--", color=line.get_color(), lw=0.9)
        ax_t.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="time (ms)", title=f"n = {n}; dashed: alpha-beta fit")
        ax_b.set(xscale="log", xlabel="message bytes", ylabel="bus bandwidth (GB/s)", title=f"n = {n}")
        for ax in (ax_t, ax_b):
            ax.grid(alpha=0.3, which="both")
        ax_t.legend(fontsize=8)
    return _save(fig, out, "collectives")


def comm_vs_n(records: list[dict[str, Any]], fits: list[Fit], out: Path) -> list[Path]:
    """Figure 3: time of one synchronization of a fixed size against n, measured points and the
    fitted alpha-beta lines extended to 64 workers; and the parameter server against its shard
    count k at the largest measured n (BytePS's analysis)."""
    by_key = {(f.link, f.impl): f for f in fits}
    sizes = [r["bytes"] for r in records if r["impl"] in FALLBACK_IMPLS] or [r["bytes"] for r in records]
    size = max(set(sizes), key=lambda s: (sizes.count(s), s))  # the most common size, the largest on ties
    at_size = [r for r in records if r["bytes"] == size and r.get("correct", True)]
    fig, (ax_n, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    grid = np.unique(np.geomspace(1, 64, 20).astype(int))
    series = {(r["link"], r["impl"]) for r in at_size if not r["impl"].startswith("ps_k") or r["impl"] == "ps_k1"}
    for link, impl in sorted(series):
        points = sorted((int(r["world_size"]), r["time_s"]) for r in at_size if (r["link"], r["impl"]) == (link, impl))
        (line,) = ax_n.plot([n for n, _ in points], [1e3 * t for _, t in points], "o", label=f"{impl} ({link})")
        fit = by_key.get((link, impl))
        if fit is not None:
            template = {"impl": impl, "bytes": size}
            ns = [n for n in grid if n > 1 or impl.startswith("ps") or impl == "grpc_raw"]
            ax_n.plot(ns, [1e3 * model({**template, "world_size": n}).time(fit.to_link()) for n in ns], "--",
                      color=line.get_color(), lw=0.9)
            if impl == "ps_k1":  # one shard per worker, on the same transport
                ax_n.plot(ns, [1e3 * model({"impl": f"ps_k{n}", "bytes": size, "world_size": n}).time(fit.to_link())
                               for n in ns], ":", color=line.get_color(), lw=0.9, label="PS k = n (model)")
    ps = [r for r in at_size if r["impl"].startswith("ps_k")]
    if ps:
        n = max(int(r["world_size"]) for r in ps)
        points = sorted((int(r["impl"][4:]), r["time_s"]) for r in ps if int(r["world_size"]) == n)
        (line,) = ax_k.plot([k for k, _ in points], [1e3 * t for _, t in points], "o", label=f"measured, n = {n}")
        fit = by_key.get((ps[0]["link"], "ps_k1"))
        if fit is not None:
            ks = list(range(1, 2 * n + 1))
            ax_k.plot(ks, [1e3 * model({"impl": f"ps_k{k}", "bytes": size, "world_size": n}).time(fit.to_link()) for k in ks],
                      "--", color=line.get_color(), lw=0.9, label="alpha-beta (ps_k1 fit)")
        ax_k.set(xlabel="server shards k", ylabel="time per push + pull (ms)", title=f"parameter server, n = {n}")
        ax_k.legend(fontsize=8)
    ax_n.set(xscale="log", yscale="log", xlabel="workers n", ylabel="time per synchronization (ms)",
             title=f"{size / 2**20:g} MiB; dashed: fitted alpha-beta")
    for ax in (ax_n, ax_k):
        ax.grid(alpha=0.3, which="both")
    ax_n.legend(fontsize=7)
    return _save(fig, out, "comm_vs_n")


def _medians(rows: list[dict[str, Any]]) -> dict[float, float]:
    """Median time per message size over the records (several benchmark files may repeat a point)."""
    by_size: dict[float, list[float]] = {}
    for r in rows:
        by_size.setdefault(float(r["bytes"]), []).append(float(r["time_s"]))
    return {size: float(np.median(times)) for size, times in by_size.items()}


def report_section(fits: list[Fit]) -> str:
    rows = [{"link": f.link, "impl": f.impl, "alpha_us": f.alpha * 1e6, "rate": f.rate_gbit,
             "gm": 100 * f.gm_error, "max": 100 * f.max_error, "points": f.points} for f in fits]
    table = markdown_table(pd.DataFrame(rows), {"link": "link", "impl": "impl", "alpha_us": "alpha (us)",
                                                "rate": "fitted rate (Gbit/s)", "gm": "GM error %",
                                                "max": "max error %", "points": "points"})
    return "\n".join(["## Collective benchmark: alpha-beta fits", "",
                      "busbw = algbw * 2(n-1)/n. The fit minimizes relative residuals per (link, impl).", "", table, ""])


def analyse(records: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    fits = fit_records(records)
    return draw(records, fits, out) + comm_vs_n(records, fits, out), report_section(fits)
