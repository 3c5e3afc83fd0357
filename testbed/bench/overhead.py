"""Trainer overhead: ``world_size=1 sync=none`` through the Trainer vs a plain PyTorch loop.

Same model, data, optimizer and device; both timed by wall clock over the same steps, in pairs
that alternate which goes first; file data sets come through the same DataLoader in both (the
plain loop takes its next batch, as ``for x, y in loader`` would). Throughput ratio = trainer /
plain, the median over pairs (target >= 0.97): a shared machine's speed drifts by tens of percent
within a minute, so only runs next to each other in time are compared; the throughputs printed
are each path's best repeat.

Example: python -m testbed.bench.overhead model=resnet18 data=image_folder data.root=DIR --steps 5 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from testbed import config
from testbed.batch import per_rank_batch
from testbed.checks import enum_value, resolved_backend, resolved_device
from testbed.data import build_data
from testbed.models import build_model
from testbed.models.call import cross_entropy
from testbed.optim import build_optimizer
from testbed.paths import config_dir
from testbed.results.step_log import StepLog
from testbed.sync import build_synchronizer
from testbed.timing import synchronize
from testbed.trainer import Trainer
from testbed.world import World


def plain_loop(model, optimizer, batches, steps: int, device: torch.device, bf16: bool) -> float:
    """The loop a user would write by hand; returns seconds for ``steps`` steps."""
    synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
        x, y = batches.batch(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    synchronize(device)
    return time.perf_counter() - start


def measure(overrides: list[str], steps: int, repeats: int) -> dict:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["sync=none", "world_size=1", *overrides])
    config.validate(cfg)
    device = torch.device(resolved_device(cfg))
    world = World(0, 0, 1, 1, device, resolved_backend(cfg), cfg.timeouts.collective_s)
    bf16 = enum_value(cfg.precision) == "bf16"
    torch.manual_seed(cfg.seed)
    batch_samples = per_rank_batch(cfg)

    def data():  # a fresh stream per run: a DataLoader's batches are read once, in order
        return build_data(cfg.data, [batch_samples], 0, cfg.seed, device)

    spec = data()[0]

    def fresh():
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, spec).to(device)
        return model, build_optimizer(cfg.optim, model.parameters())

    def run_trainer(r: int, tmp: str) -> float:
        model, opt = fresh()
        sync = build_synchronizer(cfg.sync)
        sync.setup(model, opt, world)
        log = StepLog(Path(tmp) / f"rank0-{r}.jsonl")
        batches = data()[1]
        trainer = Trainer(opt, sync, batches, world, log, steps, bf16=bf16, log_every=10**9)
        synchronize(device)
        start = time.perf_counter()
        trainer.run()
        synchronize(device)
        log.close()
        batches.close()
        return time.perf_counter() - start

    def run_plain() -> float:
        batches = data()[1]
        elapsed = plain_loop(*fresh(), batches, steps, device, bf16)
        batches.close()
        return elapsed

    plain_s, trainer_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats + 1):  # round 0 warms up both paths and is discarded
            # Alternate which path goes first, so that neither always runs on a warmer machine.
            if r % 2:
                t_trainer = run_trainer(r, tmp)
                t_plain = run_plain()
            else:
                t_plain = run_plain()
                t_trainer = run_trainer(r, tmp)
            if r:
                plain_s.append(t_plain)
                trainer_s.append(t_trainer)
    plain_tp = steps * batch_samples / min(plain_s)
    trainer_tp = steps * batch_samples / min(trainer_s)
    ratio = statistics.median(p / t for p, t in zip(plain_s, trainer_s))
    return {
        "overrides": overrides, "device": str(device), "steps": steps, "repeats": repeats,
        "plain_samples_per_s": plain_tp, "trainer_samples_per_s": trainer_tp, "ratio": ratio,
        "plain_s": plain_s, "trainer_s": trainer_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=cnn data.batch_size=64")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = measure(args.overrides, args.steps, args.repeats)
    print(
        f"{' '.join(args.overrides) or 'defaults'} on {result['device']}: plain {result['plain_samples_per_s']:.1f}"
        f" samples/s, trainer {result['trainer_samples_per_s']:.1f} samples/s, ratio {result['ratio']:.3f}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
