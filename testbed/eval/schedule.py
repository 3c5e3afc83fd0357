"""The learning-rate schedule every synchronizer follows: a scaling rule, gradual warmup, a decay.

One ``LrSchedule`` gives the learning rate of every step. The trainer sets it on the optimizer
before each step's synchronization (so synchronizers that step their own optimizer, local SGD,
follow it), and the parameter server's shards, which run the optimizer for their workers, are
handed the same schedule and step with it at the same step (testbed.ps.shard).

- Scaling (Goyal et al. 2017): the peak rate is ``optim.lr`` times ``k = global batch /
  optim.base_batch`` (linear) or ``sqrt(k)``; ``base_batch`` null is ``data.batch_size``.
- Warmup: over the first W steps (``optim.warmup_steps``, or ``optim.warmup_epochs`` of the
  training data), the rate climbs linearly, reaching the peak at step W - 1: from ``optim.lr`` when
  a scaling rule raised the peak (Goyal's gradual warmup), from 0 otherwise.
- Decay after warmup: ``constant``; ``cosine`` to ``optim.min_lr`` at the last step; ``step``,
  times ``optim.gamma`` at each of ``optim.milestones`` (steps).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import OmegaConf

from testbed.batch import global_batch
from testbed.checks import require
from testbed.optim import LrScheduleConfig

SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("constant", "cosine", "step")


@dataclass(frozen=True)
class LrSchedule:
    peak: float
    start: float  # the rate warmup begins from
    warmup: int  # steps
    total: int  # steps of the run
    kind: str = "constant"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    floor: float = 0.0  # cosine's final rate

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.start + (self.peak - self.start) * (step + 1) / self.warmup
        if self.kind == "cosine":
            span = max(1, self.total - 1 - self.warmup)
            progress = min(1.0, (step - self.warmup) / span)
            return self.floor + (self.peak - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "step":
            return self.peak * self.gamma ** sum(step >= m for m in self.milestones)
        return self.peak

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "milestones": list(self.milestones)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LrSchedule:
        return cls(**{**values, "milestones": tuple(values.get("milestones", ()))})

    @classmethod
    def of_optim(cls, optim: Any) -> LrSchedule:
        """The schedule a parameter server was handed in its optim config (``lr_schedule``, see
        ``with_schedule``); without one, a constant optim.lr."""
        def field(key: str, default: Any) -> Any:  # a config node, a dict, or an optim dataclass
            return optim.get(key, default) if hasattr(optim, "get") else getattr(optim, key, default)

        values = field("lr_schedule", None)
        if values is None:
            return cls(peak=float(field("lr", 0.0)), start=0.0, warmup=0, total=1)
        return cls.from_dict(OmegaConf.to_container(values) if OmegaConf.is_config(values) else dict(values))


def with_schedule(plain: dict[str, Any], train_size: int | None) -> dict[str, Any]:
    """The run's optim config with its resolved schedule, for the parameter servers that step for it."""
    return {**plain["optim"], "lr_schedule": schedule_of(OmegaConf.create(plain), train_size).as_dict()}


def scale_factor(cfg: Any, batch: int | None = None) -> float:
    """The scaling rule's multiplier of optim.lr for this run's global batch (or ``batch``: one an
    elastic membership makes)."""
    rule = cfg.optim.get("lr_scaling", "none")
    if rule == "none":
        return 1.0
    base = cfg.optim.get("base_batch") or int(cfg.data.batch_size)
    k = (batch or global_batch(cfg)) / base
    return k if rule == "linear" else math.sqrt(k)


def warmup_steps(cfg: Any, train_size: int | None) -> int:
    optim = cfg.optim
    if optim.get("warmup_epochs"):
        require(train_size is not None, f"optim.warmup_epochs={optim.warmup_epochs}: data={cfg.data.name} does not "
                                        "say its size before it loads; give optim.warmup_steps")
        return math.ceil(float(optim.warmup_epochs) * train_size / global_batch(cfg))
    return int(optim.get("warmup_steps", 0))


def schedule_of(cfg: Any, train_size: int | None, global_batch: int | None = None) -> LrSchedule:
    """This run's schedule (``train_size``: training samples, for warmup_epochs); with
    ``global_batch``, its peak scaled for that batch instead of the configured one (the warmup
    keeps its steps)."""
    optim = cfg.optim
    base = float(optim.lr)
    peak = base * scale_factor(cfg, global_batch)
    return LrSchedule(
        peak=peak, start=base if peak != base else 0.0, warmup=warmup_steps(cfg, train_size), total=int(cfg.steps),
        kind=optim.get("schedule", "constant"), milestones=tuple(int(m) for m in optim.get("milestones", ())),
        gamma=float(optim.get("gamma", 0.1)), floor=float(optim.get("min_lr", 0.0)),
    )


def check_schedule(cfg: Any, train_size: int | None) -> None:
    optim = cfg.optim
    require(optim.lr_scaling in SCALINGS, f"optim.lr_scaling={optim.lr_scaling}: allowed: {'|'.join(SCALINGS)}")
    require(optim.schedule in SCHEDULES, f"optim.schedule={optim.schedule}: allowed: {'|'.join(SCHEDULES)}")
    require(optim.base_batch is None or optim.base_batch >= 1,
            f"optim.base_batch={optim.base_batch}: the batch optim.lr is tuned for, >= 1 (null: data.batch_size)")
    require(optim.warmup_steps >= 0 and optim.warmup_epochs >= 0,
            "optim.warmup_steps and optim.warmup_epochs: must be >= 0")
    require(not (optim.warmup_steps and optim.warmup_epochs),
            "optim.warmup_steps and optim.warmup_epochs are both set: give one")
    warmup = warmup_steps(cfg, train_size)
    require(warmup <= int(cfg.steps),
            f"optim.warmup_{'epochs' if optim.warmup_epochs else 'steps'}: a warmup of {warmup} steps is longer than "
            f"the run (steps={cfg.steps}); shorten the warmup or raise steps")
    require(optim.gamma > 0, f"optim.gamma={optim.gamma}: must be > 0")
    require(optim.min_lr >= 0, f"optim.min_lr={optim.min_lr}: must be >= 0")
    # Options of one schedule, set for another, would be silently ignored; a floor above the peak
    # would make the cosine "decay" upward.
    defaults = LrScheduleConfig()
    require(optim.schedule == "cosine" or optim.min_lr == defaults.min_lr,
            f"optim.min_lr={optim.min_lr} is the cosine schedule's floor, and optim.schedule={optim.schedule} has "
            "none; set optim.schedule=cosine or drop optim.min_lr")
    require(optim.schedule == "step" or optim.gamma == defaults.gamma,
            f"optim.gamma={optim.gamma} is the step schedule's factor, and optim.schedule={optim.schedule} has none; "
            "set optim.schedule=step or drop optim.gamma")
    peak = schedule_of(cfg, train_size).peak
    require(optim.min_lr <= peak, f"optim.min_lr={optim.min_lr} is above the peak rate {peak:g} (optim.lr, "
                                  f"optim.lr_scaling={optim.lr_scaling}): a cosine would rise to it, not decay; "
                                  "set optim.min_lr below the peak")
    milestones = list(optim.milestones)
    require(milestones == sorted(milestones) and all(0 < m < int(cfg.steps) for m in milestones),
            f"optim.milestones={milestones}: increasing steps inside (0, steps={cfg.steps})")
    require(optim.schedule == "step" or not milestones, f"optim.milestones are for optim.schedule=step, not {optim.schedule}")
