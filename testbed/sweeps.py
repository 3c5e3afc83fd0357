"""Sweep points not run: those left out, and those done already.

Hydra's basic sweeper runs the whole cartesian product of its parameters, and some combinations
cannot run (a parameter server cannot carry PowerSGD's two all-reduces): a config's
``sweep_exclude`` names them, and such a job is skipped before it is checked or spawned. A sweep
run again into its own directory with ``sweep_resume=true`` skips every job whose result is there,
ok, for the same config, so a sweep stopped at job 37 of 60 goes on from job 37.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from testbed.results.summary import config_hash


def excluded(overrides: Iterable[str], exclude: Sequence[Sequence[str]]) -> list[str] | None:
    """The entry of ``exclude`` whose overrides a job's ``overrides`` all include, else None."""
    given = {o.lstrip("+") for o in overrides}
    for entry in exclude or ():
        if entry and all(str(o).lstrip("+") in given for o in entry):
            return [str(o) for o in entry]
    return None


def finished(job_dir: Path, plain: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of ``job_dir`` when it is ok and of the config ``plain``, else None (to run)."""
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):  # none yet, or cut short by the stop that ended the sweep
        return None
    if summary.get("status") == "ok" and summary.get("config_hash") == config_hash(plain):
        return summary
    return None
