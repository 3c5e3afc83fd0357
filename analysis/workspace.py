"""``python -m analysis.workspace entity/project/group``: a saved W&B workspace for one sweep.

Sections: scaling (efficiency, speed-up and throughput against world_size, runs grouped by
synchronizer), the per-step phase breakdown, loss against wall-clock, bytes per step, and a run
comparer; its runs are the sweep's job runs (the group, without its analysis run). The panels name
only keys the runs log (``referenced`` lists them; tested against an offline run): the job runs'
config and summary, their per-step history, and the efficiency the sweep's analysis writes into
their summaries (analysis.dashboard). Needs the
``wandb-workspaces`` package (the ``dashboards`` extra) and W&B online.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from testbed.timing import PHASES


def build(entity: str, project: str, group: str) -> Any:
    """The workspace object (nothing is sent until it is saved)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    n = wr.Config("world_size")
    scaling = [
        wr.ScatterPlot(title="scaling efficiency", x=n, y=wr.SummaryMetric("efficiency")),
        wr.ScatterPlot(title="efficiency against the common n=1", x=n, y=wr.SummaryMetric("efficiency_common")),
        wr.ScatterPlot(title="speed-up", x=n, y=wr.SummaryMetric("speedup")),
        wr.ScatterPlot(title="throughput (samples/s)", x=n, y=wr.SummaryMetric("throughput")),
    ]
    breakdown = [wr.BarPlot(title="median phase times (s)", metrics=[wr.SummaryMetric(f"phases/t_{p}") for p in PHASES]),
                 wr.BarPlot(title="step time (s)", metrics=[wr.SummaryMetric("step_time")])]
    return ws.Workspace(
        entity=entity, project=project, name=f"testbed: {group}",
        sections=[
            ws.Section(name="Scaling", panels=scaling, is_open=True),
            ws.Section(name="Per-step breakdown", panels=breakdown, is_open=True),
            ws.Section(name="Loss against wall-clock", is_open=True,
                       panels=[wr.LinePlot(title="loss", x="wall_s", y=["loss"], smoothing_factor=0.6)]),
            ws.Section(name="Bytes per step", is_open=True, panels=[
                wr.LinePlot(title="bytes sent per step", x="Step", y=["bytes_sent"]),
                wr.BarPlot(title="bytes per step (median)", metrics=[wr.SummaryMetric("bytes_per_step")]),
            ]),
            ws.Section(name="Sync time", panels=[wr.LinePlot(title="sync and step time (s)", x="Step", y=["t_sync", "t_step"])]),
            ws.Section(name="Runs", panels=[wr.RunComparer(diff_only="split")], is_open=True),
        ],
        runset_settings=ws.RunsetSettings(
            filters=expr.And(expr.Metric("Group") == group, expr.Metric("JobType") != "analysis"),
            groupby=[expr.Metric("JobType")],  # the job type is the synchronizer's label
        ),
    )


def referenced(workspace: Any) -> dict[str, set[str]]:
    """The keys the workspace's panels name, by where a run must hold them (W&B's own axis ``Step`` aside)."""
    import wandb_workspaces.reports.v2 as wr

    out: dict[str, set[str]] = {"config": set(), "summary": set(), "history": set()}

    def add(value: Any) -> None:
        if isinstance(value, wr.Config):
            out["config"].add(value.name)
        elif isinstance(value, wr.SummaryMetric):
            out["summary"].add(value.name)
        elif isinstance(value, wr.Metric):
            out["history"].add(value.name)
        elif isinstance(value, str) and value != "Step":
            out["history"].add(value)

    for section in workspace.sections:
        for panel in section.panels:
            for field in ("x", "y", "metrics"):
                value = getattr(panel, field, None)
                for item in value if isinstance(value, list) else [value]:
                    add(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.workspace", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="entity/project/group: the sweep's W&B group (its jobs' summary.json: wandb_group)")
    args = parser.parse_args(argv)
    try:
        entity, project, group = args.path.split("/", 2)
    except ValueError:
        parser.error(f"path={args.path}: give entity/project/group")
    workspace = build(entity, project, group)
    workspace.save()
    print(workspace.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
