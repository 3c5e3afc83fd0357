"""The ``stats`` config group and its checks (before anything is spawned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.checks import require


@dataclass
class StatsConfig:
    # The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018), estimated every step
    # from each rank's local gradient norm and the averaged gradient's (testbed.stats.noise_scale).
    noise_scale: bool = False
    # Moving averages of the estimator's numerator and denominator: weight of the past per step.
    ema: float = 0.95
    # Goodput's reference batch B₀ (Pollux): the batch its learning rate was tuned at; null: the
    # global batch this config has on one rank (data.batch_size × sync.accumulate).
    base_batch: int | None = None


def check_stats(cfg: Any, unseen: str | None) -> None:
    """``unseen``: why a rank of this synchronizer cannot see its own gradient before it is
    averaged and the average after (testbed.sync.spec.SyncSpec.averaged_gradient); None: it can."""
    stats = cfg.stats
    require(0.0 <= stats.ema < 1.0, f"stats.ema={stats.ema}: the weight of the past, must be in [0, 1)")
    require(stats.base_batch is None or stats.base_batch >= 1, f"stats.base_batch={stats.base_batch}: must be >= 1 or null")
    if not stats.noise_scale:
        return
    sync = cfg.sync.name
    require(cfg.world_size >= 2, f"stats.noise_scale with world_size={cfg.world_size}: the estimate compares one "
                                 "rank's gradient with the mean of several; use world_size >= 2")
    require(unseen is None, f"stats.noise_scale with sync={sync}: {unseen}")
