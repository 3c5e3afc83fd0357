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
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from testbed import config
from testbed.batch import per_rank_batch
from testbed.checks import enum_value, resolved_backend, resolved_device
from testbed.data import build_data
from testbed.data.batches import BatchSource
from testbed.models import build_model, objective_batches
from testbed.models.call import ModelCall, cross_entropy, model_call
from testbed.optim import build_optimizer
from testbed.paths import config_dir
from testbed.results.step_log import StepLog
from testbed.step_record import StepRecord
from testbed.sync import spec_of
from testbed.timing import synchronize
from testbed.trainer import Trainer
from testbed.world import World


def plain_loop(model, optimizer, batches, steps: int, device: torch.device, bf16: bool, call: ModelCall) -> float:
    """The loop a user would write by hand; returns seconds for ``steps`` steps. A model that
    computes its own loss (``model.loss=model``) is called as the trainer calls it."""
    synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
        x, y = batches.batch(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = cross_entropy(model(x), y) if call.loss_from is None else call(model, x, y).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    synchronize(device)
    return time.perf_counter() - start


class SingleRank:
    """One rank's model, data, optimizer, synchronizer and trainer, built from Hydra overrides the way
    a rank of ``python -m testbed`` builds them: the benchmarks' common ground."""

    def __init__(self, overrides: list[str]) -> None:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["world_size=1", *overrides])
        config.validate(cfg)
        self.cfg = cfg
        self.device = torch.device(resolved_device(cfg))
        self.world = World(0, 0, 1, 1, self.device, resolved_backend(cfg), cfg.timeouts.collective_s)
        self.bf16 = enum_value(cfg.precision) == "bf16"
        self.batch_samples = per_rank_batch(cfg)
        self.spec, batches = self.data()
        batches.close()

    def data(self) -> tuple[Any, BatchSource]:
        """A fresh stream per run (a DataLoader's batches are read once, in order), as the model trains on it."""
        spec, batches = build_data(self.cfg.data, [self.batch_samples], 0, self.cfg.seed, self.device)
        return spec, objective_batches(self.cfg.model, batches, spec, self.cfg.seed, 0)

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.cfg.model, self.spec).to(self.device)
        return model, build_optimizer(self.cfg.optim, model.parameters())

    def run_trainer(self, steps: int, log_path: Path, trainer_cls: type[Trainer] = Trainer) -> tuple[float, Trainer, list[StepRecord]]:
        """Seconds of wall clock for ``steps`` trainer steps, the trainer and its records."""
        model, opt = self.fresh()
        sync = spec_of(self.cfg.sync.name).impl(self.cfg.sync, self.cfg.compress, int(self.cfg.seed))
        sync.setup(model, opt, self.world)
        log = StepLog(log_path)
        batches = self.data()[1]
        trainer = trainer_cls(opt, sync, batches, self.world, log, steps, bf16=self.bf16, log_every=10**9,
                              call=model_call(self.cfg.model))
        try:
            synchronize(self.device)
            start = time.perf_counter()
            records = trainer.run()
            synchronize(self.device)
            return time.perf_counter() - start, trainer, records
        finally:
            log.close()
            batches.close()
            sync.close()

    def run_plain(self, steps: int) -> float:
        batches = self.data()[1]
        elapsed = plain_loop(*self.fresh(), batches, steps, self.device, self.bf16, model_call(self.cfg.model))
        batches.close()
        return elapsed


def measure(overrides: list[str], steps: int, repeats: int) -> dict:
    rank = SingleRank(["sync=none", *overrides])
    batch_samples, device = rank.batch_samples, rank.device
    plain_s, trainer_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats + 1):  # round 0 warms up both paths and is discarded
            # Alternate which path goes first, so that neither always runs on a warmer machine.
            if r % 2:
                t_trainer = rank.run_trainer(steps, Path(tmp) / f"rank0-{r}.jsonl")[0]
                t_plain = rank.run_plain(steps)
            else:
                t_plain = rank.run_plain(steps)
                t_trainer = rank.run_trainer(steps, Path(tmp) / f"rank0-{r}.jsonl")[0]
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
