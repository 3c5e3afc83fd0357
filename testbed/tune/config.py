"""The ``tune`` group: how ``python -m testbed.tune`` searches (training runs ignore it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TuneConfig:
    """How ``python -m testbed.tune`` searches (training runs ignore it): testbed.tune."""

    objective: str = "throughput"  # throughput | time_to_target (of the measured candidates)
    # The knobs searched: a list of keys (each with its default candidates, testbed.tune.space) or
    # a mapping of keys to their candidates: {sync:[ring,ps],sync.bucket_mb:[1,25]}; null: [sync,
    # sync.bucket_mb, sync.overlap].
    space: Any = None
    budget: int = 6  # real runs: the best predicted candidates, `repeats` runs each
    repeats: int = 2
    screen_max: int = 200  # simulator predictions; a larger space is searched with Optuna's TPE
    calibration: str = "docs/sim/calibration.json"  # link fits; a link they lack is benchmarked first
    compute_from: str | None = None  # a world_size=1 job of this setting; null: one is run first
