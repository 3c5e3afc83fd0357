"""``python -m testbed.tune <the setting's overrides> tune.space=... tune.objective=... tune.budget=...``

1. Calibrate: a measured world_size=1 run of the setting (its compute; ``tune.compute_from`` skips
   it) and the link's fits from ``tune.calibration`` (a link it lacks is benchmarked first).
2. Screen the space in the simulator: every candidate when there are at most ``tune.screen_max``,
   else that many drawn by Optuna's TPE. A candidate the calibration can cost only with a stand-in
   fit (a parameter server on a link benchmarked for all-reduce only) has its own benchmarked and
   fitted, and the space is screened again.
3. Measure the best ``budget // repeats`` predicted candidates, ``repeats`` runs each, and rank
   them by the objective: measured throughput, or time to the held-out quality target (the
   simulator predicts time, not accuracy, so that objective ranks the measured candidates only).
4. Print the ranked table; write tuning.md, tuning.json and tuning.png into the run directory, with
   every run a normal job directory (``trials/``) that ``python -m analysis`` reads.

  python -m testbed.tune model=mlp world_size=2 tune.space={sync:[allreduce,ring,ps],compress:[none,fp16]} tune.budget=4
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed import config
from testbed.checks import ConfigError, require
from testbed.paths import config_dir, in_checkout
from testbed.tune import space as tune_space
from testbed.tune import trials

OBJECTIVES = ("throughput", "time_to_target")


def _check(cfg: DictConfig) -> dict[str, list[Any]]:
    config.validate(cfg)  # the setting itself, as its runs will be
    tune = cfg.tune
    require(tune.objective in OBJECTIVES, f"tune.objective={tune.objective}: allowed: {'|'.join(OBJECTIVES)}")
    require(tune.objective != "time_to_target" or cfg.target.metric is not None,
            "tune.objective=time_to_target ranks candidates by time to a held-out quality target: give one "
            "(target.metric=accuracy target.value=0.85, with eval.every=...)")
    require(tune.repeats >= 1, f"tune.repeats={tune.repeats}: must be >= 1")
    require(tune.budget >= tune.repeats, f"tune.budget={tune.budget}: must be at least tune.repeats={tune.repeats} "
                                         "(real runs: candidates x repeats)")
    require(tune.screen_max >= 1, f"tune.screen_max={tune.screen_max}: must be >= 1")
    calibration = in_checkout(tune.calibration)
    require(calibration.is_file(), f"tune.calibration={tune.calibration}: no such file (python -m testbed.sim.calibrate writes one)")
    if tune.compute_from:
        require((Path(tune.compute_from) / "summary.json").is_file(), f"tune.compute_from={tune.compute_from}: no job there")
    return tune_space.knobs(tune.space)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    base = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith(("tune.", "hydra."))]
    try:
        knobs = _check(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    tune = cfg.tune
    began = time.perf_counter()
    # Every rank runs on this machine: the simulator slows the compute by ranks x threads over its
    # cores, and the single worker runs with the threads one rank of the setting gets.
    cores = os.cpu_count() or 1
    threads = int(cfg.threads_per_rank) or max(1, cores // int(cfg.world_size))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    calibration = trials.calibration_for(cfg, in_checkout(tune.calibration), out)
    compute_from = tune.compute_from or str(trials.single_worker(base, out, threads))
    sim = {"calibration": str(calibration), "compute_from": compute_from, "cores": cores}
    screened = tune_space.screen(base, knobs, sim, int(tune.screen_max), int(cfg.seed), progress=print)
    lacking = frozenset(c.lacks for c in screened.candidates if c.lacks and trials.benchmarked(c.lacks))
    if lacking:  # costed with a stand-in: measure the link for them and screen again
        print(f"the calibration has no {', '.join(sorted(lacking))} fit for this link: benchmarking it", flush=True)
        calibration = trials.calibration_for(cfg, calibration, out, lacking)
        sim["calibration"] = str(calibration)
        screened = tune_space.screen(base, knobs, sim, int(tune.screen_max), int(cfg.seed), progress=print)
    screen_s = time.perf_counter() - began
    best = screened.ranked()[: max(1, int(tune.budget) // int(tune.repeats))]
    if not best:
        reasons = "; ".join(sorted({c.why.split(";")[0] for c in screened.candidates}))
        print(f"no candidate could be predicted: {reasons}", file=sys.stderr)
        sys.exit(1)
    started = time.perf_counter()
    measured = trials.measure(base, best, int(tune.repeats), int(cfg.seed), out)
    measure_s = time.perf_counter() - started
    target = trials.add_time_to_target(measured) if tune.objective == "time_to_target" else None
    ranked = trials.rank(measured, tune.objective)
    facts = {"objective": tune.objective, "target": target, "base": base, "space": knobs, "repeats": int(tune.repeats),
             "calibration": sim["calibration"], "compute_from": compute_from, "screen_s": screen_s,
             "measure_s": measure_s, "wall_s": time.perf_counter() - began, "method": screened.method}
    table = trials.write(out, screened, ranked, facts)
    print(f"\n{table}\n", flush=True)
    if not ranked[0].throughput:
        print(f"no measured candidate ran: see {out / 'logs'}", file=sys.stderr)
        sys.exit(1)
    print(f"best: {ranked[0].candidate.label}\ntuning: {out} (tuning.md, tuning.png, trials/)", flush=True)
    return {"best": list(ranked[0].candidate.overrides), "wall_s": facts["wall_s"]}


if __name__ == "__main__":
    main()
