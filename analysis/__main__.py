"""``python -m analysis <sweep or job dirs ... | wandb:entity/project/group | bench JSON ...> [--out DIR] [--wandb]``

Loads the runs, prints the comparison table, and writes figures (PNG and PDF) and ``report.md``:
scaling efficiency and throughput against workers, speed-up and marginal speed-up (diminishing
returns), step time, idle fraction and time to a target loss against every other swept override,
loss against wall-clock time, held-out accuracy against wall-clock and samples and time to the
held-out target with its interval (analysis.accuracy), steps to target against the global batch
with the critical batch fitted and B_simple's prediction (analysis.critical_batch), the per-step
time breakdown, and, where runs differ in codec, each codec against none under each synchronizer,
and on two-level networks what crossed each machine's uplink; where a worker was lost, elastic
membership against a restart (analysis.elastic); model state and peak memory per rank against
throughput, with ZeRO's formula (analysis.memory). Given the JSON records of
``python -m testbed.bench`` (and ``testbed.bench.ps``), it draws the collective benchmark (figure 2)
with the alpha-beta fits the simulator uses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from analysis import (
    accuracy,
    collectives,
    compression,
    critical_batch,
    dashboard,
    elastic,
    figures,
    memory,
    published,
    staleness,
    topology,
    validation,
)
from analysis.load import load
from analysis.metrics import aggregate, aggregate_by, breakdown, loss_curves, swept_keys, time_to_target
from analysis.report import write_report
from testbed.results.summary import load_summaries
from testbed.results.table import comparison_rows, format_table, write_csv
from testbed.sim.calibrate import load_records
from testbed.sim.validate import validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="sweep or job directories (searched recursively), wandb:entity/project/group, or benchmark JSON files")
    parser.add_argument("--out", type=Path, help="where figures and report.md go (default: <first dir>/analysis)")
    parser.add_argument("--csv", type=Path, help="also write the comparison table as CSV")
    parser.add_argument("--calibration", help="link fits (python -m testbed.sim.calibrate): predict every run and draw figure 9")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="with --calibration: cores the runs shared")
    parser.add_argument("--target-loss", type=float, help="loss for time-to-target (default: the worst final loss among the runs)")
    parser.add_argument("--wandb", action="store_true", help="also log the analysis as a W&B run in the sweep's group (analysis.dashboard)")
    parser.add_argument("--wandb-mode", choices=("offline", "online"), help="with --wandb (default: the jobs' wandb.mode; offline if they had none)")
    args = parser.parse_args(argv)
    bench = [s for s in args.sources if s.endswith(".json")]
    if bench:
        if len(bench) != len(args.sources):
            parser.error("sources: give either benchmark JSON files or run directories, not both")
        return _bench(bench, args.out or Path(bench[0]).with_suffix(""))
    local = [Path(s) for s in args.sources if not s.startswith("wandb:")]
    try:  # each local directory searched once: the table, the frames and the validation share it
        by_source = {s: load_summaries([Path(s)]) for s in args.sources if not s.startswith("wandb:")}
        runs, steps = load(args.sources, by_source)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    summaries = [summary for s in args.sources if s in by_source for summary in by_source[s]]
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
    curves = loss_curves(runs, steps)
    times, target = time_to_target(curves, args.target_loss)
    runs["time_to_target"] = runs["source"].map(times)
    written: list[Path] = []
    if not curves.empty:
        written += figures.convergence(curves, target, out)
    if not table.empty:
        if table["world_size"].nunique() > 1:
            written += figures.scaling(table, out)
            written += figures.diminishing_returns(table, out)
        ok = runs[runs["status"] == "ok"]
        for key in swept_keys(ok):
            by_key = aggregate_by(ok, key)
            written += figures.versus(by_key, key, out)
        written += figures.step_breakdown(runs, out)
    sections = [published.horovod_section(table)] if not table.empty else []
    figs, section = accuracy.analyse(runs, out)
    written += figs
    sections.append(section)
    figs, section = critical_batch.analyse(runs, out)
    written += figs
    sections.append(section)
    figs, section = compression.analyse(runs, out)
    written += figs
    sections.append(section)
    figs, section = topology.analyse(summaries, out)
    written += figs
    sections.append(section)
    figs, section = elastic.analyse(summaries, out)
    written += figs
    sections.append(section)
    figs, section = memory.analyse(summaries, out)
    written += figs
    sections.append(section)
    figs, section = staleness.analyse(summaries, out)
    written += figs
    sections.append(section)
    if args.calibration:
        figs, section = validation.analyse(validate(summaries, args.calibration, args.cores), out)
        written += figs
        sections.append(section)
    phases = breakdown(runs)
    report = write_report(out, args.sources, runs, table, written, phases, target, sections)
    print(f"\nfigures and report: {out} ({len(written)} files, {report.name})")
    if args.wandb:
        wandb_target = dashboard.Target.of(summaries, args.sources[0], args.wandb_mode)
        where = dashboard.log_analysis(wandb_target, dashboard.tables(table, phases, runs, steps), written, report,
                                       dashboard.job_updates(runs), out)
        print(f"W&B analysis run ({wandb_target.mode}, group {wandb_target.group}): {where}")
    return 0


def _bench(paths: list[str], out: Path) -> int:
    """Figure 2 and the alpha-beta fits from collective/PS benchmark records."""
    records = load_records(paths)
    written, section = collectives.analyse(records, out)
    (out / "report.md").write_text(f"# Collective benchmark\n\nSources: {', '.join(paths)}.\n\n{section}")
    print(section)
    print(f"figures and report: {out} ({len(written)} files, report.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
