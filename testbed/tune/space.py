"""The tuner's search space, and its screening in the simulator.

A candidate is a set of overrides on the setting being tuned (``sync=ring sync.bucket_mb=4``). A
knob applies only where the composed config has it (``sync.bucket_mb`` means nothing to ``ps``):
candidates that differ only in knobs that do not apply are one candidate. Each is validated like a
real run and predicted by the simulator (testbed.sim.step) with the setting's calibrated link and
single-worker compute; one it cannot predict (a link the calibration lacks) or that cannot run
(a parameter server with PowerSGD) is kept with the reason.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.checks import ConfigError
from testbed.paths import config_dir
from testbed.sim.step import simulate

# Candidates of each knob when the space names it without values.
DEFAULTS: dict[str, list[Any]] = {
    "sync": ["allreduce", "ring", "tree", "ps", "ddp"],
    "sync.bucket_mb": [1, 4, 25],
    "sync.overlap": [False, True],
    "sync.accumulate": [1, 2, 4],
    "sync.servers": [1, 2, 4],
    "compress": ["none", "fp16", "topk", "powersgd"],
}


@dataclass
class Candidate:
    overrides: tuple[str, ...]  # the knobs that apply, as overrides
    predicted: float = math.nan  # samples/s
    predicted_step_s: float = math.nan
    why: str = ""  # why it was not predicted
    fit: str = ""  # the link fit its communication was costed with (a fallback says so); "" if none
    lacks: str = ""  # the impl the calibration has no fit of on this link (costed with a fallback)

    @property
    def label(self) -> str:
        return " ".join(self.overrides) or "(the setting as given)"


@dataclass
class Screen:
    candidates: list[Candidate] = field(default_factory=list)
    method: str = "grid"  # or "tpe": Optuna sampled the space
    size: int = 0  # candidates in the space (knob combinations, before those that do not apply merge)

    def ranked(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if not math.isnan(c.predicted)), key=lambda c: -c.predicted)


SPACE = ["sync", "sync.bucket_mb", "sync.overlap"]  # tune.space=null


def knobs(space: Any) -> dict[str, list[Any]]:
    """``tune.space`` as {knob: candidates}: a list of knobs takes DEFAULTS, a mapping its own."""
    given = OmegaConf.to_container(space) if OmegaConf.is_config(space) else space or SPACE
    if isinstance(given, dict):
        out = {str(k): list(v) if v else DEFAULTS.get(str(k), []) for k, v in given.items()}
    else:
        out = {str(k): DEFAULTS.get(str(k), []) for k in given or []}
    empty = [k for k, v in out.items() if not v]
    if empty:
        raise ConfigError(f"tune.space: no candidates for {', '.join(empty)}; give them, e.g. "
                          f"tune.space={{{empty[0]}:[a,b]}} (defaults exist for {', '.join(DEFAULTS)})")
    return out


def _groups() -> set[str]:
    return {p.name for p in Path(config_dir()).iterdir() if p.is_dir()}


def compose_candidate(base: list[str], assignment: dict[str, Any]) -> tuple[DictConfig, tuple[str, ...]]:
    """The config of ``base`` overrides with the knobs of ``assignment`` that apply, and those knobs
    as overrides. Config groups (sync, compress, ...) are chosen first; then each plain key that the
    composed config has is set."""
    groups = _groups()
    chosen = [f"{k}={_text(v)}" for k, v in assignment.items() if k in groups]
    cfg = compose(config_name="config", overrides=[*base, *chosen])
    applied = list(chosen)
    for key, value in assignment.items():
        if key in groups:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, value, merge=False)
            applied.append(f"{key}={_text(value)}")
    return cfg, tuple(applied)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def predict(cfg: DictConfig, sim: dict[str, Any], applied: tuple[str, ...]) -> Candidate:
    """The candidate ``applied`` (composed as ``cfg``) with its predicted samples/s and step time,
    or NaNs and why not."""
    with open_dict(cfg):
        cfg.sim = OmegaConf.merge(cfg.sim, sim)
    try:  # validated as a run of it would be (on loopback: the simulator builds no network)
        summary = simulate(cfg)
    except ConfigError as exc:
        return Candidate(applied, why=str(exc))
    fit, lacks = fit_used(summary["sync_facts"])
    return Candidate(applied, float(summary["throughput"]), float(summary["step_time"]), fit=fit, lacks=lacks)


def fit_used(facts: dict[str, Any]) -> tuple[str, str]:
    """(which fit the simulator costed the communication with, ``<link>/<impl>`` with the impl it
    stood in for where the calibration had none of its own; that impl, else "")."""
    link = facts.get("link")
    if link is None:
        return "", ""
    if link["source"] != "calibration":
        return f"nominal {link['rate']}", ""
    used = f"{link['link']}/{link['impl']}"
    return (used, "") if link["impl"] == facts["impl"] else (f"{used} (for {facts['impl']})", facts["impl"])


def screen(base: list[str], space: dict[str, list[Any]], sim: dict[str, Any], screen_max: int, seed: int,
           progress: Callable[[str], None] = lambda line: None) -> Screen:
    """Predict the space's candidates: every one when there are at most ``screen_max`` combinations,
    else ``screen_max`` drawn by Optuna's TPE (maximizing predicted throughput)."""
    names = list(space)
    size = math.prod(len(v) for v in space.values())
    seen: dict[tuple[str, ...], Candidate] = {}

    def evaluate(assignment: dict[str, Any]) -> Candidate:
        try:
            cfg, applied = compose_candidate(base, assignment)
        except Exception as exc:  # a composition Hydra refuses: an option that does not exist
            applied = tuple(f"{k}={_text(v)}" for k, v in assignment.items())
            return seen.setdefault(applied, Candidate(applied, why=" ".join(str(exc).split())))
        if applied not in seen:
            found = seen[applied] = predict(cfg, sim, applied)
            progress(f"[screen {len(seen)}] {found.label}: " + (f"{found.predicted:.1f} samples/s predicted" if not found.why
                                                                else f"not predicted ({found.why.split(';')[0]})"))
        return seen[applied]

    if size <= screen_max:
        for values in itertools.product(*space.values()):
            evaluate(dict(zip(names, values)))
        return Screen(list(seen.values()), "grid", size)
    return Screen(_tpe(names, space, evaluate, screen_max, seed), "tpe", size)


def _tpe(names: list[str], space: dict[str, list[Any]], evaluate: Callable[[dict[str, Any]], Candidate],
         trials: int, seed: int) -> list[Candidate]:
    try:
        import optuna
    except ImportError:
        raise ConfigError(f"tune.screen_max={trials} is below the space's size: searching it needs Optuna "
                          "(pip install -e '.[tune]'), or raise tune.screen_max to screen it all") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    found: dict[tuple[str, ...], Candidate] = {}

    def objective(trial: Any) -> float:
        # Optuna's choices must be plain values: each knob's candidates by index.
        assignment = {k: space[k][trial.suggest_categorical(k, list(range(len(space[k]))))] for k in names}
        candidate = evaluate(assignment)
        found[candidate.overrides] = candidate
        return candidate.predicted if not math.isnan(candidate.predicted) else 0.0

    study.optimize(objective, n_trials=trials)
    return list(found.values())
