"""``python -m testbed.tune.grid <tuning dir> [--repeats N]``: check a tuning against the full grid.

Every candidate the tuner screened is measured ``--repeats`` times with the tuning's setting (jobs
under ``<tuning dir>/grid/trials``, normal job directories), and ``grid.md`` / ``grid.json`` set
the tuner against it: the grid's measured throughput of the tuner's pick over the grid's best, the
candidates within the noise of that best, the tuner's wall time over the grid's, and how well the
simulator ranked the grid (geometric-mean error of the predictions, Spearman's rank correlation).

  python -m testbed.tune.grid outputs/2026-12-03/12-00-00 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.results.format import markdown_table, text_table
from testbed.tune import trials
from testbed.tune.space import Candidate

COLUMNS = {"knobs": "knobs", "predicted": "predicted samples/s", "measured": "measured samples/s", "std": "± std",
           "ratio": "measured/predicted", "runs": "runs", "failed": "failed"}


def compare(tuning: dict[str, Any], grid: list[trials.Measured], grid_s: float) -> dict[str, Any]:
    """The tuner (``tuning.json``'s content) against the measured ``grid`` (ranked, best first)."""
    rows = [m.row() for m in grid if m.throughput]
    best, pick = rows[0], tuning["measured"][0]["knobs"]
    picked = next((r for r in rows if r["knobs"] == pick), None)
    errors = [abs(math.log(r["measured"] / r["predicted"])) for r in rows if r["predicted"] > 0]
    frame = pd.DataFrame(rows)
    return {
        "best": best["knobs"], "best_measured": best["measured"], "pick": pick,
        "pick_measured": picked["measured"] if picked else math.nan,
        "pick_over_best": picked["measured"] / best["measured"] if picked else math.nan,
        "within_noise_of_best": [m.candidate.label for m in trials.within_noise(grid)],
        "tuner_s": tuning["wall_s"], "grid_s": grid_s, "tuner_over_grid": tuning["wall_s"] / grid_s,
        "prediction_gm_error": math.exp(statistics.fmean(errors)) - 1 if errors else math.nan,
        "spearman": float(frame["predicted"].corr(frame["measured"], method="spearman")) if len(rows) > 1 else math.nan,
    }


def write(out: Path, grid: list[trials.Measured], verdict: dict[str, Any], repeats: int) -> str:
    rows = pd.DataFrame([{"rank": i + 1, **m.row()} for i, m in enumerate(grid)])
    columns = {"rank": "#", **COLUMNS}
    v = verdict
    lines = [
        f"Tuner's pick: {v['pick']}, measured here at {v['pick_measured']:.1f} samples/s: {v['pick_over_best']:.3f}x the "
        f"grid's best ({v['best']}, {v['best_measured']:.1f}).",
        f"Within the noise of the grid's best: {'; '.join(v['within_noise_of_best']) or 'none'}.",
        f"Wall time: tuner {v['tuner_s']:.0f} s, grid {v['grid_s']:.0f} s ({repeats} runs per candidate): "
        f"{v['tuner_over_grid']:.3f}x.",
        f"Predictions against the grid: geometric-mean error {100 * v['prediction_gm_error']:.1f} %, Spearman rank "
        f"correlation {v['spearman']:.2f}.",
    ]
    (out / "grid.md").write_text("\n".join(["# The tuner against the full grid", "", *lines, "",
                                            markdown_table(rows, columns, optional=("failed",)), ""]))
    (out / "grid.json").write_text(json.dumps({**verdict, "repeats": repeats, "grid": rows.to_dict("records")},
                                              indent=2, default=str) + "\n")
    return text_table(rows, columns, optional=("failed",)) + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.tune.grid", description=__doc__.splitlines()[0])
    parser.add_argument("tuning", type=Path, help="a python -m testbed.tune run directory (holds tuning.json)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per candidate")
    parser.add_argument("--seed", type=int, default=0, help="the first run's seed; the others follow")
    args = parser.parse_args(argv)
    path = args.tuning / "tuning.json"
    if not path.is_file():
        parser.error(f"{path}: no such file; give the directory python -m testbed.tune wrote")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    tuning = json.loads(path.read_text())
    candidates = [Candidate(tuple(c["overrides"]), c["predicted"]) for c in tuning["screened"]
                  if not math.isnan(c["predicted"])]
    began = time.perf_counter()
    measured = trials.measure(tuning["base"], candidates, args.repeats, args.seed, args.tuning / "grid")
    grid_s = time.perf_counter() - began
    grid = trials.rank(measured, "throughput")
    if not grid[0].throughput:
        print(f"no grid run succeeded: see {args.tuning / 'grid' / 'logs'}")
        return 1
    print(write(args.tuning, grid, compare(tuning, grid, grid_s), args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
