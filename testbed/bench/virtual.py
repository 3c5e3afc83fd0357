"""``python -m testbed.bench.virtual``: what a virtual cluster costs here, per simulated worker-step.

Runs each synchronizer family at each world size on mnist1d's MLP (launcher=virtual, a given
compute time, so nothing is timed but the run itself) and prints the wall-clock seconds per
simulated worker-step, with the mean staleness of the asynchronous parameter server beside
n - 1, its expectation for n equal workers.

  python -m testbed.bench.virtual --world-sizes 16,64,256 --steps 20
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from testbed import config
from testbed.launch.virtual.run import run_virtual
from testbed.paths import config_dir

SYNCS = {"allreduce": ["sync=allreduce"], "local_sgd": ["sync=local_sgd"], "ps_sync": ["sync=ps"],
         "ps_async": ["sync=ps", "sync.mode=async"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="16,64,256")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"{'sync':>10} {'n':>5} {'wall s':>8} {'ms/worker-step':>15} {'mean staleness':>15}")
    for n in (int(x) for x in args.world_sizes.split(",")):
        for name, overrides in SYNCS.items():
            with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
                cfg = compose(config_name="config", overrides=[
                    "data=mnist1d", "model=mlp", "data.batch_size=32", f"world_size={n}", f"steps={args.steps}",
                    "warmup_steps=2", "eval.at_end=false", "launcher=virtual", "cluster=here",
                    "cluster.compute.ms_per_sample=0.05", *overrides])
            config.validate(cfg)
            with tempfile.TemporaryDirectory() as job:
                began = time.perf_counter()
                summary = run_virtual(cfg, config.to_plain(cfg), Path(job))
                wall = time.perf_counter() - began
            histogram = summary.get("staleness_histogram")
            staleness = sum(s * c for s, c in enumerate(histogram)) / sum(histogram) if histogram else None
            print(f"{name:>10} {n:>5} {wall:>8.2f} {1e3 * wall / (n * args.steps):>15.3f} "
                  f"{'-' if staleness is None else f'{staleness:.2f}':>15}", flush=True)


if __name__ == "__main__":
    main()
