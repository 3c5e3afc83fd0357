"""``python -m analysis <sweep or job dirs ... | wandb:entity/project/group> [--out DIR]``

Loads the runs, prints the comparison table, and writes figures (PNG and PDF) and ``report.md``:
scaling efficiency and throughput against workers, speed-up and marginal speed-up (diminishing
returns), step time against every other swept override, and the per-step time breakdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis import figures
from analysis.load import load
from analysis.metrics import aggregate, aggregate_by, breakdown, swept_keys
from analysis.report import write_report
from testbed.results.summary import load_summaries
from testbed.results.table import comparison_rows, format_table, write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="sweep or job directories (searched recursively), or wandb:entity/project/group")
    parser.add_argument("--out", type=Path, help="where figures and report.md go (default: <first dir>/analysis)")
    parser.add_argument("--csv", type=Path, help="also write the comparison table as CSV")
    args = parser.parse_args(argv)
    local = [Path(s) for s in args.sources if not s.startswith("wandb:")]
    try:
        runs, _ = load(args.sources)
        summaries = load_summaries(local)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if runs.empty:
        print("no runs found (no job directory with a summary.json)", file=sys.stderr)
        return 1
    if summaries:
        rows = comparison_rows(summaries)
        print(format_table(rows))
        if args.csv:
            write_csv(rows, args.csv)

    out = args.out or (local[0] / "analysis" if local else Path("analysis-out"))
    table = aggregate(runs)
    written: list[Path] = []
    if not table.empty:
        if table["world_size"].nunique() > 1:
            written += figures.scaling(table, out)
            written += figures.diminishing_returns(table, out)
        ok = runs[runs["status"] == "ok"]
        for key in swept_keys(ok):
            by_key = aggregate_by(ok, key)
            written += figures.versus(by_key, key, out)
        written += figures.step_breakdown(runs, out)
    report = write_report(out, args.sources, runs, table, written, breakdown(runs))
    print(f"\nfigures and report: {out} ({len(written)} files, {report.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
