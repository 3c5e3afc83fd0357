"""``python -m analysis <sweep or job dirs...> [--csv FILE]``: the comparison table of finished jobs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.results.summary import load_summaries
from testbed.results.table import comparison_rows, format_table, write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or job directories (searched recursively)")
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    args = parser.parse_args(argv)
    try:
        summaries = load_summaries(args.dirs)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if not summaries:
        print("no job directories with a summary.json found", file=sys.stderr)
        return 1
    rows = comparison_rows(summaries)
    print(format_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
