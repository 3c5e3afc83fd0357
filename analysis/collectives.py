"""Figure 2: the collective micro-benchmark (nccl-tests style) with its fitted alpha-beta lines.

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
from analysis.report import markdown_table  # noqa: E402
from testbed.sim.calibrate import Fit, fit_records, model  # noqa: E402


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


def _medians(rows: list[dict[str, Any]]) -> dict[float, float]:
    """Median time per message size over the records (several benchmark files may repeat a point)."""
    by_size: dict[float, list[float]] = {}
    for r in rows:
        by_size.setdefault(float(r["bytes"]), []).append(float(r["time_s"]))
    return {size: float(np.median(times)) for size, times in by_size.items()}


def report_section(fits: list[Fit]) -> str:
    rows = [{"link": f.link, "impl": f.impl, "alpha_us": f.alpha * 1e6, "rate": f.rate_gbit,
             "gm": 100 * f.gm_error, "max": 100 * f.max_error, "points": f.points} for f in fits]  # fmt: skip
    table = markdown_table(pd.DataFrame(rows), {"link": "link", "impl": "impl", "alpha_us": "alpha (us)",
                                                "rate": "fitted rate (Gbit/s)", "gm": "GM error %",
                                                "max": "max error %", "points": "points"})  # fmt: skip
    return "\n".join(["## Collective benchmark: alpha-beta fits", "",
                      "busbw = algbw * 2(n-1)/n. The fit minimizes relative residuals per (link, impl).", "", table, ""])


def analyse(records: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    fits = fit_records(records)
    return draw(records, fits, out), report_section(fits)
