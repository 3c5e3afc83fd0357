"""Repeats and their uncertainty: one point per configuration is a median with a 95 % interval, and
a difference inside the intervals is a tie, never a finding.

The interval is Student's t interval of the mean over the repeats (seeds): mean ± t(0.975, r - 1)
s / sqrt(r). With three repeats it is wide (t = 4.30), as it should be: three runs say little. A
single run has no interval (NaN), and is never called faster than anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from scipy import stats as scipy_stats

LEVEL = 0.95


def interval(values: Sequence[float]) -> tuple[float, float]:
    """The 95 % t interval of the mean of ``values`` (NaN for fewer than two)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return math.nan, math.nan
    mean, sem = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
    half = scipy_stats.t.ppf(0.5 + LEVEL / 2, len(values) - 1) * sem
    return mean - half, mean + half


def point(values: Sequence[float]) -> dict[str, float]:
    """Median, mean, the interval and the count of the finite ``values``."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    lo, hi = interval(finite)
    return {"median": statistics.median(finite) if finite else math.nan,
            "mean": statistics.fmean(finite) if finite else math.nan, "lo": lo, "hi": hi, "n": len(finite)}


def cell(values: Sequence[float], digits: int) -> str:
    """The mean of ``values`` with its 95 % interval, for a table: "1.23 (1.10-1.36)"; "-" for none."""
    p = point(values)
    if not p["n"]:
        return "-"
    text = f"{p['mean']:.{digits}f}"
    return text if math.isnan(p["lo"]) else f"{text} ({p['lo']:.{digits}f}-{p['hi']:.{digits}f})"


def verdicts(points: list[dict[str, float]], higher_is_better: bool) -> list[str]:
    """For points measured under one setting: "best" for the best median, "tie" for each whose
    interval overlaps the best's (or either has none: nothing tells them apart), "" otherwise."""
    ranked = [p for p in points if math.isfinite(p["median"])]
    if not ranked:
        return ["" for _ in points]
    best = (max if higher_is_better else min)(ranked, key=lambda p: p["median"])
    out = []
    for p in points:
        if p is best:
            out.append("best")
        elif not math.isfinite(p["median"]):
            out.append("")
        elif not (math.isfinite(p["lo"]) and math.isfinite(best["lo"])):
            out.append("tie")
        else:
            out.append("tie" if p["lo"] <= best["hi"] and best["lo"] <= p["hi"] else "")
    return out


def mlperf_score(times: Sequence[float]) -> float:
    """MLPerf Training's score of repeated runs' times to target: drop the fastest and the slowest,
    average the rest. A run that did not reach the target is slowest (infinite); with another
    unreached one left, or fewer than three runs, there is no score (NaN)."""
    ordered = sorted(math.inf if t is None or math.isnan(t) else t for t in times)
    if len(ordered) < 3:
        return math.nan
    kept = ordered[1:-1]
    return statistics.fmean(kept) if all(math.isfinite(t) for t in kept) else math.nan
