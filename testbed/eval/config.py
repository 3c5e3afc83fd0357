"""The ``eval`` and ``target`` config groups, and their checks (before anything is spawned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.checks import require

# Quality metrics and which way is better.
HIGHER_IS_BETTER = {"accuracy": True, "top5": True, "loss": False, "perplexity": False}


@dataclass
class EvalConfig:
    """Held-out evaluation of the run's model (testbed.eval.evaluate)."""

    every: int = 0  # steps between evaluations during the run; 0: none
    samples: int | None = None  # the first this many of the held-out split; null: all of it
    at_end: bool = True  # evaluate the final model (skipped for data without a held-out split)
    # Samples per forward pass on each rank; null: the training batch per rank, so that a language
    # model's logits (batch x seq_len x vocabulary) take no more memory than in training.
    batch_size: int | None = None


@dataclass
class TargetConfig:
    """A quality target on the held-out split (MLPerf's time to train): summary.json time_to_target."""

    metric: str | None = None  # accuracy | top5 | loss | perplexity; null: no target
    value: float | None = None
    stop: bool = False  # every rank stops at the first evaluation that meets it (MLPerf)


def evaluates(cfg: Any, heldout_missing: str | None) -> bool:
    """Whether this run evaluates at all."""
    return heldout_missing is None and (int(cfg.eval.every) > 0 or bool(cfg.eval.at_end))


def check_eval(cfg: Any, heldout_missing: str | None, metrics: tuple[str, ...]) -> None:
    """``heldout_missing``: why the data has no held-out split (None when it has one); ``metrics``:
    what evaluating this model on this data measures (testbed.eval.metrics.metrics_of)."""
    ev, target = cfg.eval, cfg.target
    require(ev.every >= 0, f"eval.every={ev.every}: steps between evaluations, must be >= 0 (0: none during the run)")
    require(ev.samples is None or ev.samples >= 1, f"eval.samples={ev.samples}: must be >= 1, or null for the whole split")
    require(ev.batch_size is None or ev.batch_size >= 1, f"eval.batch_size={ev.batch_size}: must be >= 1 (null: the training batch)")
    require(not (ev.every and heldout_missing), f"eval.every={ev.every}: {heldout_missing}")
    if target.metric is None:
        require(target.value is None and not target.stop,
                "target.value/target.stop without target.metric: name the metric (accuracy|top5|loss|perplexity)")
        return
    require(target.metric in HIGHER_IS_BETTER,
            f"target.metric={target.metric}: allowed: {'|'.join(HIGHER_IS_BETTER)}")
    require(target.value is not None, f"target.metric={target.metric} needs target.value (e.g. target.value=0.9)")
    require(heldout_missing is None, f"target.metric={target.metric}: {heldout_missing}")
    require(ev.every > 0 or ev.at_end,
            f"target.metric={target.metric}: no evaluation to meet it at; set eval.every > 0 (or eval.at_end=true)")
    require(target.metric in metrics,
            f"target.metric={target.metric}: this model and data measure {'|'.join(metrics)} (top5: over 5 classes; "
            "perplexity: language models)")
    if target.metric in ("accuracy", "top5"):
        require(0 < target.value <= 1, f"target.value={target.value}: an accuracy is a fraction in (0, 1]")
