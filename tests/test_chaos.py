"""A chaos sweep: every injected fault, at the steps its seeds draw, in one sweep that goes on past
each failure (its own module, so that it runs beside the other fault tests, not after them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from conftest import assert_nothing_left, read_json, run_cli
from omegaconf import OmegaConf

from testbed.faults import fault_step


def test_a_chaos_sweep_ends_every_job_as_its_fault_says(tmp_path: Path) -> None:
    """Every fault at the step each seed draws, one sweep (+experiment=chaos at two of its three
    seeds, an early and a late step; the link outage too where emulated links can be built): each
    job's status and error as its fault says, the sweep going on past each failure, nothing left
    behind by any job."""
    sweep = tmp_path / "chaos"
    root = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
    extra = ["network=emulated", "fault=none,kill_rank,kill_ps,nan_loss,link_down"] if root else []
    proc = run_cli(["+experiment=chaos", "seed=0,5", *extra, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [d for d in sweep.iterdir() if (d / "summary.json").exists()]
    assert len(jobs) == (10 if root else 8)
    seen = set()
    for job in jobs:
        summary = read_json(job / "summary.json")
        fault, seed, error = summary["config"]["fault"], summary["config"]["seed"], summary["error"]
        step = fault_step(OmegaConf.create(fault), seed, summary["config"]["steps"])
        seen.add((fault["name"], step))
        expected = {  # (kind, rank, step) of the error each fault must leave
            "none": None,
            "kill_rank": ("killed", 1, step),
            "nan_loss": ("nonfinite_loss", 0, None if step is None else step + 1),  # its NaN step recorded
            "kill_ps": ("parameter_server", 0, step),
            "link_down": ("stall", 1, step),
        }[fault["name"]]
        if expected is None:
            assert summary["status"] == "ok" and error is None, job.name
        else:
            kind, rank, at = expected
            if fault["name"] == "kill_ps":  # every worker loses the server: whichever reports first is named
                rank = error["rank"] if error["rank"] in (0, 1) else rank
                assert error["shard"] == fault["shard"], (job.name, error)
            assert summary["status"] == "failed" and (error["kind"], error["rank"]) == (kind, rank), (job.name, error)
            # The steps every rank recorded: a peer may still be finishing the step before when the
            # fault strikes, and under load a peer stopped in a call may lose its last unflushed records.
            assert at - 3 <= error["step"] <= at, (job.name, error)
        assert_nothing_left(job)
    assert len({step for name, step in seen if name != "none"}) == 2  # two different steps drawn
    assert "Comparison (" in proc.stdout
