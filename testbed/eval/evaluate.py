"""Held-out evaluation of the run's model, split over the ranks, and the quality target.

Which model is evaluated is the synchronizer's answer (``Synchronizer.evaluated``): the replicas
for synchronous training, the servers' current parameters for an asynchronous or bounded-staleness
parameter server, the replicas' average for local SGD between averaging steps. Each rank evaluates
a disjoint contiguous slice of the held-out split; one all-reduce adds their sums, so every rank
holds the same metrics and takes the same decision at a target.

The clock follows MLPerf: it never stops, evaluation counts toward time to target, and its own
time is reported apart (``t_eval``) so that its share is visible. Steady-state throughput excludes
it, because evaluation runs between steps, outside every step's timing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from testbed.batch import per_rank_batch
from testbed.data.batches import HeldOut
from testbed.data.spec import DataSpec
from testbed.eval.config import HIGHER_IS_BETTER
from testbed.eval.metrics import SUMS, batch_sums, loss_sums, metrics_from
from testbed.models.call import model_call
from testbed.world import World


def eval_path(job_dir: Path) -> Path:
    return job_dir / "metrics" / "eval.jsonl"


def slice_of(total: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous share of ``total`` held-out positions (sizes differ by at most one)."""
    return range(rank * total // world_size, (rank + 1) * total // world_size)


class Target:
    """``target.metric`` reaching ``target.value``, or nothing to reach (metric null)."""

    def __init__(self, cfg: Any) -> None:
        self.metric, self.value, self.stop = cfg.metric, cfg.value, bool(cfg.stop)

    def met(self, row: dict[str, Any]) -> bool:
        if self.metric is None or self.metric not in row:
            return False
        value = row[self.metric]
        return value >= self.value if HIGHER_IS_BETTER[self.metric] else value <= self.value

    def describe(self) -> dict[str, Any] | None:
        return None if self.metric is None else {"metric": self.metric, "value": self.value, "stop": self.stop}


class Evaluator:
    """Evaluates every ``eval.every`` steps (and the final model), writes ``metrics/eval.jsonl`` on
    rank 0, and remembers the first row that meets the target."""

    def __init__(self, cfg: Any, heldout: HeldOut, spec: DataSpec, world: World, job_dir: Path,
                 global_batch: int, train_samples: int | None, autocast: Any,
                 on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.every, self.at_end = int(cfg.eval.every), bool(cfg.eval.at_end)
        self.batch_size = int(cfg.eval.batch_size or per_rank_batch(cfg))
        self.total = min(len(heldout), int(cfg.eval.samples or len(heldout)))
        self.heldout, self.spec, self.world = heldout, spec, world
        self.autocast = autocast if autocast is not None else nullcontext()
        self.global_batch, self.train_samples = global_batch, train_samples
        self.call = model_call(cfg.model)
        self.target = Target(cfg.target)
        self.rows: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self.diverged: dict[str, Any] | None = None  # the first evaluation whose loss was not finite
        self.t_eval = 0.0
        self._file = open(eval_path(job_dir), "a") if world.is_main else None
        self.on_row = on_row  # e.g. the W&B mirror (rank 0)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    @torch.no_grad()
    def evaluate(self, sync: Any, step: int, elapsed_s: float, charged_s: float | None = None) -> dict[str, Any]:
        """Evaluate the run's model after ``step`` (0-based), ``elapsed_s`` into the run; the row.
        ``charged_s``: the evaluation's time on a simulated clock (testbed.launch.virtual), in place
        of the time it takes here."""
        began = time.perf_counter()
        device = self.world.device
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        with sync.evaluated() as (model, which):  # which: the facts of the evaluated model
            was_training = model.training
            model.eval()
            try:
                mine = slice_of(self.total, self.world.rank, self.world.world_size)
                for lo in range(mine.start, mine.stop, self.batch_size):
                    inputs, targets = self.heldout.take(range(lo, min(lo + self.batch_size, mine.stop)))
                    targets = targets.to(device)
                    with self.autocast:
                        loss, logits = self.call(model, inputs.to(device), targets)
                    sums += batch_sums(logits, targets) if logits is not None else loss_sums(loss, targets)
            finally:
                model.train(was_training)
        if self.world.world_size > 1:
            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        t_eval = time.perf_counter() - began if charged_s is None else charged_s
        self.t_eval += t_eval
        done = step + 1
        row = {
            "step": step, "samples_seen": done * self.global_batch,
            "epoch": done * self.global_batch / self.train_samples if self.train_samples else None,
            "time_s": elapsed_s + t_eval, "t_eval": t_eval, "t_eval_total": self.t_eval, **which,
            **metrics_from(sums, self.spec, self.call.has_logits),
        }
        self.rows.append(row)
        if self.reached is None and self.target.met(row):
            self.reached = row
        if self.diverged is None and not math.isfinite(float(row.get("loss", 0.0))):
            self.diverged = row  # parameters gone to inf or NaN: no later step recovers them
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self.on_row is not None:
            self.on_row(row)
        return row

    def stop_now(self) -> bool:
        """Every rank stops here (target.stop) once the target is met, or once the held-out loss is no
        longer finite (a diverged run never meets it): the metrics, and so the decision, are the
        same on all."""
        return self.target.stop and (self.reached is not None or self.diverged is not None)

    def summary(self) -> dict[str, Any]:
        """summary.json's ``eval`` and ``time_to_target``."""
        metric = self.target.metric or ("accuracy" if self.call.has_logits else "loss")
        scored = [r for r in self.rows if metric in r]
        better = HIGHER_IS_BETTER.get(metric, True)
        best = (max if better else min)(scored, key=lambda r: r[metric]) if scored else None
        out: dict[str, Any] = {
            "eval": {"final": self.rows[-1] if self.rows else None, "best": best, "best_by": metric,
                     "evaluations": len(self.rows), "samples": self.total, "t_eval_total": self.t_eval},
        }
        target = self.target.describe()
        if target is not None:
            reached = self.reached
            out["time_to_target"] = {
                **target, "reached": reached is not None,
                "seconds": reached["time_s"] if reached else None,
                "steps": reached["step"] + 1 if reached else None,
                "samples": reached["samples_seen"] if reached else None,
                "epochs": reached["epoch"] if reached else None,
                "t_eval_share": reached["t_eval_total"] / reached["time_s"] if reached else None,
                "status": "reached" if reached else "diverged" if self.diverged else "not reached",
            }
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
