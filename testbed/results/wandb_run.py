"""Mirror a job to Weights & Biases: one W&B run per Hydra job, written by rank 0 only.

The run starts after the process group and the parameter servers are up (so a failed start-up is
not a W&B run) with ``group`` = the sweep (``group_name`` of its directory), ``job_type`` = the
synchronizer, a name from the job's overrides and ``config`` = the resolved config plus those
overrides. Every step's record is logged against the ``step`` key as it ends, with ``wall_s``, the
run's time so far (the sum of its step times, as the analysis draws loss against wall-clock);
``summary.json``'s fields become the run summary. W&B is a mirror, never a dependency: if it fails
or cannot reach its server, one warning is printed and training goes on. ``wandb.mode=disabled``
(the default) does not even import it.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.checks import require
from testbed.step_record import StepRecord

WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline (written under the job dir, synced later) | online
    project: str = "testbed"
    entity: str | None = None
    group: str | None = None  # null: the sweep's directory (a single run: its own directory)
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 60.0  # an unreachable server costs at most this, once


def check_wandb(cfg: Any) -> None:
    require(cfg.mode in WANDB_MODES, f"wandb.mode={cfg.mode}: allowed: {'|'.join(WANDB_MODES)}")

log = logging.getLogger("testbed")

# Per-step fields worth a chart; absolute timestamps and the rank would only clutter the dashboard.
_SKIP = {"rank", "t_sync_enter", "t_sync_exit"}
_ROOTS = ("", "/", "tmp")  # path components that name no experiment


def group_name(directory: Path) -> str:
    """A sweep's W&B group: the last two components of its directory, which the Makefile and Hydra
    name by experiment and time (``compare/2026-12-03_08-56-04``, ``2026-11-30/10-00-00``), without
    a bare root such as /tmp (``hydra.run.dir=/tmp/wb`` gives ``wb``). ``wandb.group`` overrides it."""
    parts = [p for p in directory.absolute().parts[-2:] if p not in _ROOTS]
    return "/".join(parts) or str(directory)


class WandbRun:
    """A W&B run for rank 0, or nothing (``mode=disabled``, other ranks, or after a failure)."""

    def __init__(self, wandb_cfg: Any, plain_cfg: dict[str, Any], job_dir: Path, identity: dict[str, Any]) -> None:
        self.run: Any = None
        self.wall_s = 0.0
        if wandb_cfg.mode == "disabled":
            return
        self._guard("start", self._start, wandb_cfg, plain_cfg, job_dir, identity)

    def _start(self, wandb_cfg: Any, plain_cfg: dict[str, Any], job_dir: Path, identity: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            mode=wandb_cfg.mode,
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=identity["group"],
            job_type=identity["job_type"],
            name=identity["name"],
            tags=list(wandb_cfg.tags),
            # The overrides say which runs of a group share a configuration (analysis pairs them by it).
            config={**plain_cfg, "overrides": list(identity["overrides"])},
            dir=str(job_dir),
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, init_timeout=float(wandb_cfg.init_timeout_s)),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # W&B down, unreachable, misconfigured: the run goes on without it
            log.warning("W&B %s failed, continuing without it: %s: %s", what, type(exc).__name__, exc)
            self.run = None

    def log_step(self, record: StepRecord) -> None:
        if self.run is not None:
            self.wall_s += record.t_step
            metrics = {k: v for k, v in record.to_json().items() if k not in _SKIP and v is not None}
            self._guard("log", self.run.log, {**metrics, "wall_s": self.wall_s})

    def log_eval(self, row: dict[str, Any]) -> None:
        """A held-out evaluation (testbed.eval): a history row of its own, ``eval/<field>``, whose
        ``eval/step`` and ``eval/time_s`` are its axes (the step records hold ``step``)."""
        if self.run is not None:
            metrics = {f"eval/{k}": v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            self._guard("log", self.run.log, metrics)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if self.run is None:
            return
        run = self.run
        if summary is not None:
            self._guard("summary", run.summary.update, summary_metrics(summary))
        self._guard("finish", run.finish, 0 if summary is not None and summary.get("status") == "ok" else 1)
        self.run = None


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields of summary.json, with phase medians as ``phases/<name>``."""
    out = {k: v for k, v in summary.items() if isinstance(v, int | float | str | bool) or v is None}
    for phase, spread in (summary.get("phases") or {}).items():
        out[f"phases/{phase}"] = spread.get("median")
    final = (summary.get("eval") or {}).get("final") or {}
    out.update({f"eval/final_{k}": v for k, v in final.items() if k in ("loss", "accuracy", "top5", "perplexity")})
    reached = summary.get("time_to_target") or {}
    out.update({f"time_to_target/{k}": v for k, v in reached.items() if k in ("seconds", "steps", "samples", "reached")})
    return out


def remove_import_temporaries() -> None:
    """Remove the temporary directories wandb makes when imported (media, artifacts). wandb removes
    them at interpreter exit, which a rank skips: it ends with os._exit (multiprocessing), and each
    W&B job left two empty directories in the system's temporary directory."""
    private, artifact = sys.modules.get("wandb.sdk.data_types._private"), sys.modules.get("wandb.sdk.artifacts.artifact")
    for made in (getattr(private, "MEDIA_TMP", None), getattr(getattr(artifact, "Artifact", None), "_TMP_DIR", None)):
        if isinstance(made, tempfile.TemporaryDirectory):
            made.cleanup()
