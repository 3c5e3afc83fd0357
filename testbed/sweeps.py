"""Sweep points not run: those left out, and those done already.

Hydra's basic sweeper runs the whole cartesian product of its parameters, and some combinations
cannot run (a parameter server cannot carry PowerSGD's two all-reduces): a config's
``sweep_exclude`` names them, and such a job is skipped before it is checked or spawned. A sweep
run again into its own directory with ``sweep_resume=true`` skips every job whose result is there,
ok, for the same config, so a sweep stopped at job 37 of 60 goes on from job 37; a job it runs
again has its earlier attempt's files set aside under ``attempts/<k>`` (kept, and not read as a job
of the sweep) and continues from that attempt's latest checkpoint where it has one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from testbed import checkpoint
from testbed.results.summary import ATTEMPTS, config_hash

HYDRA_OWN = (".hydra", "testbed.log")  # what Hydra writes into a job directory before the job runs


def _normal(override: str) -> str:
    """``+key=value`` as ``key=value``, and a boolean as written either way: a sweep over
    ``x=true,false`` names its jobs ``x=True`` and ``x=False``."""
    key, sep, value = override.lstrip("+").partition("=")
    return f"{key}{sep}{value.lower() if value in ('True', 'False') else value}"


def excluded(overrides: Iterable[str], exclude: Sequence[Sequence[str]]) -> list[str] | None:
    """The entry of ``exclude`` whose overrides a job's ``overrides`` all include, else None."""
    given = {_normal(o) for o in overrides}
    for entry in exclude or ():
        if entry and all(_normal(str(o)) in given for o in entry):
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


def set_aside(job_dir: Path) -> Path | None:
    """Move what an earlier attempt wrote into ``job_dir`` (Hydra's own files aside) to
    ``attempts/<k>``; that directory, or None when there was nothing."""
    earlier = [p for p in job_dir.iterdir() if p.name not in (*HYDRA_OWN, ATTEMPTS)] if job_dir.is_dir() else []
    if not earlier:
        return None
    attempts = job_dir / ATTEMPTS
    target = attempts / str(len(list(attempts.iterdir())) if attempts.is_dir() else 0)
    target.mkdir(parents=True)
    for path in earlier:
        shutil.move(str(path), target / path.name)
    return target


def resumable(earlier: Path, plain: dict[str, Any]) -> bool:
    """Whether the attempt in ``earlier`` has a checkpoint that a run of ``plain`` can continue
    (testbed.config checks the same for ``resume=``)."""
    if not plain["checkpoint"]["every"] or plain.get("resume") or not checkpoint.continuable(earlier, plain["steps"]):
        return False
    try:
        resumed = json.loads((earlier / "summary.json").read_text())["config"]
    except (OSError, ValueError, KeyError):
        return False
    return not checkpoint.mismatches(plain, resumed)
